"""What one request may ask of the server (serve's options), in a module without Starlette: the CLI reads the
defaults before the serve extra is needed."""

from dataclasses import dataclass

from higgs_trt.runtime.longform import DEFAULT_HISTORY

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
MAX_BODY_BYTES = 16 << 20  # a 30 s reference as base64 fits (48 kHz stereo float32: 15.4 MB)
DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_SECONDS = 600.0


@dataclass(frozen=True)
class Limits:
    timeout: float = DEFAULT_TIMEOUT  # seconds a request may take, waiting included
    max_input_chars: int = MAX_INPUT_CHARS
    max_seconds: float = DEFAULT_MAX_SECONDS  # of audio, all its segments together
    history: int = DEFAULT_HISTORY  # earlier segments of a voice in a long text's prompts
    max_body: int = MAX_BODY_BYTES
