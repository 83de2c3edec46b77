"""The `hkstore` entry point: the store's commands (hkstore/cli.py) and, mounted here above
every package, the commands that need the model. They are imported only when invoked, so the
store's commands work on an install without torch, and a command whose extra is missing says
which in one line instead of failing inside."""

import importlib
import importlib.util

import click

from hkstore import cli as store_cli

# name -> (module, attribute). tests/test_layout.py checks that each resolves and that the
# arrows they add point down.
MODEL_COMMANDS = {
    "build": ("runtime.construct.commands", "build"),
    "domain": ("runtime.construct.commands", "domain"),
    "tenant": ("runtime.student.commands", "tenant"),  # construction's, with --students
    "demo": ("runtime.demo.run", "demo"),
    "serve": ("runtime.serve.cli", "serve"),
    "report": ("tools.commands", "report"),
    "explain": ("tools.commands", "explain"),
    "infer": ("runtime.infer_cli", "infer"),
    "generate": ("runtime.gen.commands", "generate"),
    "students": ("runtime.student.commands", "students"),
    "levels": ("runtime.levels_cli", "levels"),
}
# What each extra installs that its commands import (many only inside functions, so importing
# the command's module alone would not find a missing one).
EXTRA_MODULES = {"model": ("torch", "tokenizers", "tqdm", "matplotlib"),
                 "serve": ("fastapi", "uvicorn", "prometheus_client")}
EXTRAS_OF = {"serve": ("model", "serve")}  # every other model command: ("model",)
INSTALL = {"model": "pip install torch==2.13.0 && pip install 'hkstore[model]'",
           "serve": "pip install torch==2.13.0 && pip install 'hkstore[model,serve]'"}


def missing_extra(name: str):
    """(extra, module) for the first extra that command `name` needs and lacks, else None."""
    for extra in EXTRAS_OF.get(name, ("model",)):
        for module in EXTRA_MODULES[extra]:
            if importlib.util.find_spec(module) is None:
                return extra, module
    return None


def unavailable(name: str, message: str) -> click.Command:
    # No --help of its own: asking for it fails like any other use.
    @click.command(name, help=message, add_help_option=False,
                   context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args):
        raise click.ClickException(message)

    return command


class Group(store_cli.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(MODEL_COMMANDS))

    def get_command(self, ctx, name):
        if name not in MODEL_COMMANDS:
            return super().get_command(ctx, name)
        if lack := missing_extra(name):
            extra, module = lack
            return unavailable(name, f"'hkstore {name}' needs the {extra} extra ({module} is not installed): "
                                     f"{INSTALL[extra]}")
        module, attr = MODEL_COMMANDS[name]
        return getattr(importlib.import_module(module), attr)


main = Group(name="hkstore", commands=store_cli.main.commands, params=store_cli.main.params,
             callback=store_cli.main.callback, help=store_cli.main.help)

if __name__ == "__main__":
    main()
