"""`python -m kernelkit`: the same CLI as the `kernelkit` command."""

from .commands.cli import app

if __name__ == "__main__":
    app(prog_name="kernelkit")
