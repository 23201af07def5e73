"""A file a command reads whole must be a regular file of a size that fits in memory: a fifo would block the read
forever and a device (a link to /dev/zero) never ends. One-line errors name the file."""

import stat
from pathlib import Path

from .errors import HiggsError

JSON_BYTES = 64 << 20  # config, manifest, index, prompts, calibration: the largest real one (a manifest) is ~1 MB
TOKENIZER_BYTES = 256 << 20  # Qwen3's tokenizer.json is ~11 MB
CODES_BYTES = 16 << 20  # reference codes: 2 M codes, far past any prompt
TEXT_BYTES = 16 << 20  # a text to speak: hours of speech


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def input_file(path: Path, limit: int) -> Path:
    """`path`, if it (or what its links name) is a regular file of at most `limit` bytes."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise HiggsError(f"{path}: not found") from None
    except OSError as e:
        raise HiggsError(f"{path}: unreadable ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise HiggsError(f"{path}: is {kind_of(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise HiggsError(f"{path}: {st.st_size / 2**20:,.0f} MiB, more than such a file may hold ({limit >> 20} MiB)")
    return path
