"""click's Path for every file and directory argument, refusing an empty one: Path("") is ".", so `--out ""` was
taken for the current directory and the error named "."."""

from pathlib import Path

import click


class NonEmptyPath(click.Path):
    def convert(self, value, param, ctx):
        if value == "":
            self.fail("an empty path names no file or directory", param, ctx)
        return super().convert(value, param, ctx)


PATH = NonEmptyPath(path_type=Path)
