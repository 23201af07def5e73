"""`serve`: OpenAI's speech API over the in-flight scheduler (runtime/server/)."""

import click

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.longform import DEFAULT_HISTORY
from higgs_trt.runtime.prefix_cache import DEFAULT_ENTRIES
from higgs_trt.runtime.server.limits import DEFAULT_MAX_SECONDS, DEFAULT_TIMEOUT, MAX_INPUT_CHARS

from .options import codec_precision_option, engine_source, given, precision_option, say, stream_plan, stream_plan_options
from .paths import PATH


@click.command()
@engine_source
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@precision_option
@codec_precision_option
@click.option("--max-batch", type=int, default=64, show_default=True,
              help="Engine slots: requests decoded together (at most what the engine was built for).")
@click.option("--voices", "voices_dir", type=PATH,
              help="Named voices: NAME.wav|.flac|.ogg|.mp3 (a 1–30 s recording) or NAME.npy (codes [T,8]), each with an "
                   "optional NAME.txt transcript; `voice: NAME` picks one ('default' is zero-shot).")
@click.option("--ref-dir", type=PATH,
              help="Requests may name reference audio below this directory (ref_audio: file://PATH); else only uploads.")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests waiting for a slot; past this, new ones get 429 with Retry-After.")
@click.option("--timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True,
              help="Seconds a request may take, waiting included; then it is cancelled and its slot freed.")
@click.option("--api-key", envvar="HIGGS_API_KEY",
              help="Every route but /health needs `Authorization: Bearer KEY` (what the openai client sends); also "
                   "from HIGGS_API_KEY. Without one the server is unauthenticated (it says so at start).")
@click.option("--max-input-chars", type=int, default=MAX_INPUT_CHARS, show_default=True,
              help="Longest `input` a request may send (OpenAI's limit by default; raise it for long texts, spoken "
                   "in segments).")
@click.option("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS, show_default=True,
              help="Audio one request may produce, all its segments together.")
@click.option("--history", type=click.IntRange(0, 8), default=DEFAULT_HISTORY, show_default=True,
              help="Long texts: earlier segments of the same voice carried in each segment's prompt, at most.")
@click.option("--prefix-cache", type=click.IntRange(0, 4096), default=DEFAULT_ENTRIES, show_default=True,
              help="Voices whose reference part of the prompt the engine keeps prefilled (0: off).")
@click.option("--fixed-length", is_flag=True,
              help="Benchmarks on random weights only: every request decodes exactly max_new_tokens rows (the stop "
                   "rules, which end random-weight utterances at 32 repeated rows, are off).")
@stream_plan_options
@click.pass_context
def serve(ctx, engine, checkpoint, backend, device, host, port, precision, codec_precision, max_batch, voices_dir,
          ref_dir, max_queue, timeout, api_key, max_input_chars, max_seconds, history, prefix_cache, fixed_length,
          first_chunk, chunk, context, holdback, first_holdback):
    """Serve OpenAI's POST /v1/audio/speech (plus /v1/models, /health, /metrics) on the in-flight scheduler."""
    import math

    from higgs_trt.runtime import extras
    from higgs_trt.runtime.options import seconds_within, within

    from .engines import (
        check_codec_precision,
        choose_backend,
        load_tokenizer,
        open_encoder,
        open_engine,
        open_sources,
        torch_on_cpu,
    )

    with extras.needed("serve", "higgs-trt serve"):
        from higgs_trt.runtime.server.app import Limits, SpeechService
        from higgs_trt.runtime.server.engine_thread import EngineThread
        from higgs_trt.runtime.server.run import run_server
        from higgs_trt.runtime.server.voices import VoiceStore
    if not host.strip():  # uvicorn would listen on every interface and log http://:PORT
        raise HiggsError("--host is empty; give an address (127.0.0.1, or 0.0.0.0 for every interface)")
    within("--port", port, 0, 65535)
    within("--max-batch", max_batch, 1, 4096)
    within("--max-queue", max_queue, 1, 1_000_000)
    if not (math.isfinite(timeout) and timeout > 0):
        raise HiggsError(f"--timeout must be a positive number of seconds, got {timeout}")
    within("--max-input-chars", max_input_chars, 1, 1 << 20)
    seconds_within("--max-seconds", max_seconds, 1, 86400)
    if api_key is not None and not api_key.strip():
        raise HiggsError("--api-key is empty (HIGGS_API_KEY set to nothing?); give a key, or leave it out")
    if ref_dir is not None and not ref_dir.is_dir():
        raise HiggsError(f"--ref-dir {ref_dir}: not a directory")
    stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    sources = open_sources(name, engine, checkpoint, precision, None)
    if name == "torch":
        torch_on_cpu(sources, device, precision)  # its option rules, before the server starts
    check_codec_precision(sources, device, codec_precision)
    tokenizer = load_tokenizer(sources)
    store = VoiceStore(voices_dir, tokenizer)  # every voice file checked before the server starts

    def engine_with_cache():
        model = open_engine(sources, device=device, max_batch=max_batch, precision=precision,
                            codec_precision=codec_precision, say=say)
        model.prefixes.entries = prefix_cache
        return model

    thread = EngineThread(engine_with_cache, lambda: open_encoder(sources, device), tokenizer, store.voices, max_queue,
                          lambda strides: stream_plan(first_chunk, chunk, context, holdback, first_holdback, strides,
                                                      warn=True))
    limits = Limits(timeout, max_input_chars, max_seconds, history)
    if not api_key:
        say("note: no --api-key: the server is unauthenticated; anyone who can reach it may use it")
    run_server(SpeechService(thread, tokenizer, store, ref_dir, limits, fixed_length=fixed_length, api_key=api_key),
               host, port)
