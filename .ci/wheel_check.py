"""The wheel as a user installs it, checked from outside the source tree (run by .ci/run with
the python of a fresh venv the wheel was installed into, from a folder with no sources in it).

    python wheel_check.py core        # no extras: every command that needs one says so in one line
    python wheel_check.py full DIR    # [model,serve]: every module imports, every --help works,
                                      # the quick demo runs, infer and serve answer on its store
"""

import importlib
import json
import os
import pkgutil
import socket
import subprocess
import sys
import time
import urllib.request

PACKAGES = ("formats", "hkstore", "runtime", "tools")
LAB = ("benchmarks", "experiments", "tests")
# optional extras this check does not install: a module may need them and still ship
NOT_INSTALLED_HERE = {"cupy", "cuda", "ray", "nvidia"}
# the venv's own entry point, whatever PATH says
HKSTORE = os.path.join(os.path.dirname(sys.executable), "hkstore")


def hkstore(*args, code=0, timeout=900):
    r = subprocess.run([HKSTORE, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != code:
        sys.exit(f"hkstore {' '.join(args)}: exit {r.returncode}, wanted {code}\n{r.stdout}\n{r.stderr}")
    return r


def check_installed_not_source():
    for name in PACKAGES:
        where = os.path.dirname(importlib.import_module(name).__file__)
        assert "site-packages" in where, f"{name} imported from {where}, not the installed wheel"
    for name in LAB:
        assert importlib.util.find_spec(name) is None, f"the lab package {name} is installed"


def import_everything() -> int:
    count = 0
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            try:
                importlib.import_module(info.name)
            except ImportError as e:
                if (e.name or "").split(".")[0] not in NOT_INSTALLED_HERE:
                    raise
            count += 1
    return count


def every_command():
    """(path of names) of every command and subcommand the installed CLI lists."""
    from tools.cli import main as group

    import click

    def walk(cmd, path):
        yield path
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for sub in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, sub), path + (sub,))

    return list(walk(group, ()))


def core():
    check_installed_not_source()
    from tools.cli import MODEL_COMMANDS

    for name in sorted(MODEL_COMMANDS):
        for args in ((name, "--help"), (name, "x")):
            r = hkstore(*args, code=1)
            lines = (r.stdout + r.stderr).strip().splitlines()
            assert len(lines) == 1 and "needs the" in lines[0] and "pip install" in lines[0], (args, lines)
    hkstore("--help")
    r = hkstore("info", "no-such-store", code=1)
    assert len((r.stdout + r.stderr).strip().splitlines()) == 1, r.stderr
    print(f"core install: {len(MODEL_COMMANDS)} model commands answer one line each")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_answers(store):
    token = hkstore("token", "issue", store, "which-module").stdout.strip()
    port = free_port()
    server = subprocess.Popen([HKSTORE, "serve", store, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit("hkstore serve did not come up")
                time.sleep(0.5)
        body = json.dumps({"texts": ["Return the current local date and time."]}).encode()
        req = urllib.request.Request(url + "/v1/tenants/which-module/infer", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert out["results"][0]["label"], out
    finally:
        server.terminate()
        server.wait(30)


def full(store):
    check_installed_not_source()
    modules = import_everything()
    commands = every_command()
    for path in commands:
        hkstore(*path, "--help")
    print(f"full install: {modules} modules import, {len(commands)} commands print --help")
    t = time.monotonic()
    hkstore("demo", store, "--no-progress")
    print(f"the quick demo ran in {time.monotonic() - t:.0f} s")
    r = hkstore("infer", store, "--tenant", "which-module", "--json", "Return a random integer N.")
    assert json.loads(r.stdout.splitlines()[0])["label"], r.stdout
    serve_answers(store)
    print("infer and serve answered on the demo's store")


if __name__ == "__main__":
    if sys.argv[1] == "core":
        core()
    else:
        full(sys.argv[2])
