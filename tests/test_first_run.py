"""What a newcomer meets first: bad text from Python and the shell, the store argument, the demo's
folder and its suggested query, the tenants' listings, the report's model name, the quick start."""

import json
import os
import re
import types

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
import runtime
from runtime.construct import manager
from runtime.model.tiny import make_tiny_model
from test_manager import make_data
from tools.cli import main

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
# every code point, lone surrogates included (what surrogateescape and broken JSON escapes make)
ANY_TEXT = st.lists(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=40).map("".join)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("first"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")
    manager.build(data["store"], model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, progress=False)
    held = os.path.join(root, "held.jsonl")
    with open(data["cls"]) as f, open(held, "w") as out:
        out.writelines(f.readlines()[::3])
    manager.tenants_create(data["store"], [dict(tenant="t", version="root", train_path=data["cls"], pet_type="lora",
                                                epochs=1, max_len=32, held_out_path=held)], progress=False)
    data["rt"] = runtime.open(data["store"], device="cpu", max_len=32, truncate=True)
    yield data
    data["rt"].close()


def cli(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(r) -> str:
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert not isinstance(r.exception, TypeError)
    return lines[0][len("Error: "):]


# -- text that is not valid Unicode, from Python ----------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ANY_TEXT)
def test_any_text_is_answered_or_refused_as_bad_input(env, text):
    try:
        [result] = env["rt"].infer([{"tenant": "t", "text": text}])
    except runtime.BadRequest as e:  # EmptyText, TextTooLong, the Unicode check
        if re.search("[\ud800-\udfff]", text):
            assert "lone surrogate U+" in str(e) and "not valid Unicode" in str(e)
        else:
            assert isinstance(e, runtime.EmptyText), e
        return
    assert not re.search("[\ud800-\udfff]", text) and result.label in ("math", "path")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.binary(max_size=20), st.integers(), st.lists(st.text(max_size=3), max_size=3)))
def test_a_text_that_is_no_string_is_a_bad_request(env, value):
    with pytest.raises(runtime.BadRequest, match="text must be a string"):
        env["rt"].infer([{"tenant": "t", "text": value}])


def test_a_lone_surrogate_is_named_with_its_place(env):
    with pytest.raises(runtime.BadRequest, match=r"lone surrogate U\+DCFF, the undecodable byte 0xff at character 6"):
        runtime.infer(env["store"], [{"tenant": "t", "text": "Return\udcff the sum"}], device="cpu")
    with pytest.raises(ValueError, match="lone surrogate U\\+D800"):  # the embeddings take texts alike
        env["rt"].embed(["ok", "\ud800"])


def test_odd_tenants_and_levels_are_bad_requests_not_type_errors(env):
    with pytest.raises(runtime.BadRequest, match="tenant must be a string"):
        env["rt"].infer([{"tenant": ["t"], "text": "x"}])
    with pytest.raises(runtime.BadRequest, match="level must be one of"):
        env["rt"].infer([{"tenant": "t", "text": "x", "level": ["plot"]}])


# -- the character cap -----------------------------------------------------------------------


def test_a_text_over_the_character_cap_is_refused_before_tokenizing(env):
    long = "word " * (runtime.MAX_TEXT_CHARS // 5 + 1)
    for truncate in (False, True):  # as the server: truncate cuts tokens, never a megabyte of text
        with pytest.raises(runtime.TextTooLong, match=f"{len(long):,} characters, more than 16,384"):
            env["rt"].infer([{"tenant": "t", "text": long, "truncate": truncate}])
    [ok] = env["rt"].infer([{"tenant": "t", "text": long[:runtime.MAX_TEXT_CHARS]}])  # at the cap: cut to max_len
    assert ok.truncated > 0
    message = one_line_error(cli("infer", env["store"], "--tenant", "t", "--truncate", input=json.dumps(
        {"text": "x" * 1_000_000}) + "\n"))
    assert message.startswith("stdin line 1: 1,000,000 characters, more than 16,384")


def test_the_cap_is_the_servers():
    schemas = pytest.importorskip("runtime.serve.schemas")
    assert schemas.MAX_TEXT_CHARS == runtime.MAX_TEXT_CHARS


# -- the shell: texts, JSON lines ------------------------------------------------------------


def test_infer_names_the_text_that_is_not_utf8(env):
    # an undecodable byte in argv reaches Python as a surrogate (surrogateescape)
    message = one_line_error(cli("infer", env["store"], "--tenant", "t", "fine", "bad \udcff byte"))
    assert message == "text 2: not valid UTF-8 (lone surrogate U+DCFF, the undecodable byte 0xff at character 4)"
    stdin = b'{"text": "fine"}\n{"text": "bad \xff byte"}\n'
    assert one_line_error(cli("infer", env["store"], "--tenant", "t", input=stdin)) == \
        "stdin line 2: not valid UTF-8 (byte 0xff at byte 14)"
    stdin = '{"text": "fine"}\n\n{"text": "half \\ud800 pair"}\n'
    assert one_line_error(cli("infer", env["store"], "--tenant", "t", input=stdin)).startswith(
        "stdin line 3: not valid UTF-8 (lone surrogate U+D800 at character 5)")


@pytest.mark.parametrize("line,reason", [
    ('{"text": "   "}', "the text is empty"),
    ('{"ids": [1, 99999]}', "token ids must lie in"),
    ('{"text": "a", "tenant": "ghost"}', "unknown tenant 'ghost'"),
    ('{"text": "a", "colour": 1}', "unknown request fields"),
    ('{"text": "a", "level": "full"}', "no full-depth level"),
    ('{"text": "a", "tenant": 7}', "tenant must be a string"),
])
def test_a_bad_json_line_is_named_by_its_line(env, line, reason):
    stdin = "\n".join([json.dumps({"text": env["texts"][0]}), json.dumps({"text": env["texts"][1]}), line]) + "\n"
    message = one_line_error(cli("infer", env["store"], "--tenant", "t", input=stdin))
    assert message.startswith("stdin line 3: ") and reason in message, message


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.one_of(st.binary(max_size=30), ANY_TEXT.map(lambda t: json.dumps({"text": t}))),
                      min_size=1, max_size=4))
def test_any_stdin_is_read_or_refused_by_line(lines):
    from runtime.infer_cli import _check_texts, read_requests

    raw = [x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in lines]
    try:
        requests = read_requests([x + b"\n" for x in raw], "t")
        where = [r.pop("_line") for r in requests]
        _check_texts(requests, where)
    except ValueError as e:
        assert str(e).startswith(("stdin line ", "no requests on stdin")), e
        return
    assert all(isinstance(r, dict) and 1 <= n <= len(raw) for r, n in zip(requests, where))


# -- explain ---------------------------------------------------------------------------------


def test_explain_refuses_bad_text_and_decoder_stores_in_one_line(env, tmp_path):
    message = one_line_error(cli("explain", env["store"], "--version", "root", "a \udcff b"))
    assert message.startswith("the text is not valid UTF-8 (lone surrogate U+DCFF")
    decoder = str(tmp_path / "dec")
    hkstore.create(decoder, d=8, vocab_size=10, window="causal", architecture="decoder").close()
    message = one_line_error(cli("explain", decoder, "--version", "root", "some text"))
    assert "is a decoder store" in message and "for encoder stores" in message and "config.json" not in message


# -- the store argument ----------------------------------------------------------------------

COMMANDS = [
    ["info", "{p}"], ["tree", "{p}"], ["gc", "{p}"], ["pack", "ls", "{p}"], ["tenant", "ls", "{p}"],
    ["tenant", "info", "{p}", "t"], ["tenant", "rm", "{p}", "t"], ["tenant", "eval", "{p}", "t", "--test", "{f}"],
    ["tenant", "create", "{p}", "t", "--version", "root", "--train", "{f}"], ["tenant", "update", "{p}", "t"],
    ["domain", "create", "{p}", "d", "--corpus", "{f}"], ["students", "ls", "{p}"],
    ["infer", "{p}", "--tenant", "t", "text"], ["explain", "{p}", "--version", "root", "text"],
    ["report", "{p}", "--out", "{out}"], ["generate", "{p}", "text"], ["levels", "profile", "{p}", "t", "--dev", "{f}"],
]


@pytest.mark.parametrize("kind", ["missing", "file", "empty folder"])
def test_every_command_says_the_same_line_for_what_is_no_store(tmp_path, kind):
    f = tmp_path / "a file"
    f.write_text("{}\n")
    path = {"missing": tmp_path / "nothing", "file": f, "empty folder": tmp_path / "empty"}[kind]
    if kind == "empty folder":
        path.mkdir()
    with pytest.raises(hkstore.StoreError) as e:
        hkstore.open(path)
    said = {}
    for args in COMMANDS:
        r = cli(*[a.format(p=path, f=f, out=tmp_path / "out") for a in args])
        said[" ".join(args[:2])] = one_line_error(r)
    assert set(said.values()) == {str(e.value)}, said


def test_build_into_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "x"
    f.write_text("")
    assert one_line_error(cli("build", f, "--corpus", f)) == f"{f}: is a file, not a store directory"


# -- the demo --------------------------------------------------------------------------------


def test_the_demo_refuses_a_folder_that_holds_other_files(tmp_path):
    from runtime.demo import run

    run.check_folder(str(tmp_path / "new"))  # missing, empty, or only the demo's data: fine
    (tmp_path / "empty").mkdir()
    run.check_folder(str(tmp_path / "empty"))
    (tmp_path / "started" / "demo").mkdir(parents=True)
    run.check_folder(str(tmp_path / "started"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    r = CliRunner().invoke(run.demo, [str(tmp_path / "mine"), "--no-progress"])
    assert one_line_error(r) == f"{tmp_path / 'mine'} holds other files and no store: give an empty or new " \
                                "folder (or a demo store, to resume it)"
    assert os.listdir(tmp_path / "mine") == ["thesis.tex"]


def test_the_suggested_query_is_one_the_tenant_answers_right():
    from runtime.demo import run

    def res(label, p):
        return types.SimpleNamespace(task="classification", label=label, probabilities=[p, 1 - p])

    requests = [{"tenant": "which-module", "text": "Log a message."}, {"tenant": "raises", "text": "Raise it."},
                {"tenant": "which-module", "text": "Return the weekday."},
                {"tenant": "which-module", "text": "Open a tar archive."}]
    results = [res("calendar", 0.9), res("raises", 0.99), res("calendar", 0.7), res("tarfile", 0.8)]
    gold = ["logging", "raises", "calendar", "tarfile"]
    assert run.suggested_text(requests, results, gold) == "Open a tar archive."  # right, and the surest
    assert run.suggested_text(requests[:1], results[:1], gold[:1]) == "Log a message."  # none right: the first
    assert run.next_steps("/s", "Open a tar archive.")[0].startswith(
        "hkstore infer /s --tenant which-module 'Open a tar archive.'")


# -- tenant listings -------------------------------------------------------------------------


def test_tenant_ls_and_info_show_held_out_scores_and_a_readable_time(env):
    info = manager.tenant_info(env["store"], "t")
    assert 0 <= info["levels"]["plot"]["held_out"] <= 1 and info["metric"] == "accuracy"
    r = cli("tenant", "ls", env["store"])
    assert r.exit_code == 0 and re.search(r"held-out accuracy \d\.\d{3}", r.output), r.output
    r = cli("tenant", "info", env["store"], "t")
    assert r.exit_code == 0 and re.search(r"^held-out accuracy: plot \d\.\d{3}, exact \d\.\d{3}$", r.output, re.M)
    created = re.search(r"^created: (.*)$", r.output, re.M).group(1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", created), created


def test_the_held_out_score_is_the_stored_pets(env, tmp_path):
    """A diff PET trains dense deltas and keeps the largest at export: its held-out score is the
    kept PET's, the one `tenant eval` (the serving path) scores."""
    held = os.path.join(os.path.dirname(env["cls"]), "held.jsonl")
    manager.tenants_create(env["store"], [dict(tenant="sparse", version="root", train_path=env["cls"],
                                               pet_type="diff", density=0.0005, epochs=10, lr=0.3, max_len=32,
                                               held_out_path=held)], progress=False)
    try:
        shown = manager.tenant_info(env["store"], "sparse")["levels"]["plot"]["held_out"]
        served = manager.tenant_eval(env["store"], "sparse", held)["score"]
        assert shown == pytest.approx(served, abs=1e-6)
    finally:
        manager.tenant_rm(env["store"], "sparse")


def test_a_held_out_file_and_a_share_are_not_both_given(env):
    with pytest.raises(ValueError, match="not both"):
        manager.tenants_create(env["store"], [dict(tenant="u", version="root", train_path=env["cls"], epochs=1,
                                                   max_len=32, calibration_share=0.3, held_out_path=env["cls"])],
                               progress=False)


# -- the report, the README ------------------------------------------------------------------


def test_the_report_names_the_model_the_store_was_built_from():
    from hkstore.model_name import EMBEDDED_NAME, EMBEDDED_RECORDED
    from tools.report import _named

    named = _named({"base_model": EMBEDDED_RECORDED, "model_path": None, "architecture": "encoder"})
    assert named["base_model"] == EMBEDDED_NAME and named["base_model_recorded"] == EMBEDDED_RECORDED
    assert _named({"base_model": "my/bert", "model_path": None}) == {"base_model": "my/bert", "model_path": None}


def test_the_quick_start_installs_what_the_demos_next_steps_run():
    from runtime.demo.run import next_steps
    from tools.cli import EXTRAS_OF

    text = open(README, encoding="utf-8").read()
    install = re.search(r"pip install torch==[\d.]+ && pip install '\.\[([a-z,]+)\]' && hkstore demo", text)
    assert install, "the quick start's command"
    commands = {line.split()[1] for line in next_steps("/s", "text") if line.startswith("hkstore ")}
    needed = {extra for name in commands for extra in EXTRAS_OF.get(name, ("model",))}
    assert needed <= set(install.group(1).split(",")), (needed, install.group(1))
