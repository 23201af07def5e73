"""click's Path for every file and directory argument, refusing an empty one: Path("") is ".", so `--out ""` was
taken for the current directory and the error named ".". A file output also refuses a name that ends in "/", which
Path drops ("x.wav/" would have written the file x.wav)."""

import os
from pathlib import Path

import click

from higgs_trt.runtime.outputs import NAME_MAX


class NonEmptyPath(click.Path):
    def __init__(self, *, file_output: bool = False, **kwargs):
        super().__init__(path_type=Path, **kwargs)
        self.file_output = file_output

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("an empty path names no file or directory", param, ctx)
        longest = max((len(os.fsencode(part)) for part in str(value).split(os.sep)), default=0)
        if longest > NAME_MAX:  # else the first stat() of it raises ENAMETOOLONG wherever that happens to be
            self.fail(f"a part of it is {longest} bytes long; a file or directory name holds at most {NAME_MAX}",
                      param, ctx)
        if self.file_output and value != "-" and str(value).rstrip(".").endswith(os.sep):
            self.fail(f"{value!r} names a directory (its last part is empty or a dot); give a file name", param, ctx)
        return super().convert(value, param, ctx)


PATH = NonEmptyPath()
FILE_OUT = NonEmptyPath(file_output=True)
