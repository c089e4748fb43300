"""A user's own setup gone wrong, through the real ``rlm`` command: an environment variable
with a bad value, a cache directory that cannot be written, a sandbox memory cap too small for
a kernel, a missing extra, a failed run replayed, a symlink for a context, a mistyped flag.
Each is the user's to fix, so each says what happened and what to do (exit 2, 4 or 6), never
"internal error" (exit 1, a bug)."""
from __future__ import annotations

import pytest

from conftest import REPO, Reply, assert_clean_error, endpoint_args, repl, script
from test_cli import ctx_file  # noqa: F401 - the fixture
from kernels.bwrap import sandbox_problem


def _final(srv_factory):
    return srv_factory(script([repl("FINAL('4417')")]))


# --------------------------------------------------------------------------- the environment


def test_a_bad_sandbox_variable_is_refused_before_the_run_is_journaled(cli, scripted, ctx_file):
    srv = _final(scripted)
    res = cli("run", "--context", str(ctx_file), "--query", "q", *endpoint_args(srv),
              env={"RLM_SANDBOX": "bogus"})
    assert_clean_error(res, 2, "RLM_SANDBOX='bogus'", "auto", "required", "none")
    assert srv.count == 0
    assert not cli.journal.exists()  # nothing was journaled, not even a failed run
    # the flag, when given, wins over the variable
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--sandbox", "auto",
              *endpoint_args(srv), env={"RLM_SANDBOX": "bogus"})
    assert res.rc == 0 and res.stdout.strip() == "4417", res.stderr


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(cli, scripted, ctx_file,
                                                                    tmp_path, where):
    srv = _final(scripted)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = str(blocker / "cache") if where == "under-a-file" else "/proc/rlm-cache"
    # a token cap: each call's prompt is counted (o200k) to reserve its tokens
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--max-tokens", "100000",
              *endpoint_args(srv), env={"RLM_CACHE_DIR": cache})
    assert res.rc == 0 and res.stdout.strip() == "4417", res.stderr
    assert "cannot write the token-rank cache" in res.stderr and "RLM_CACHE_DIR" in res.stderr
    runs = cli("runs")
    assert "completed" in runs.stdout and "internal error" not in runs.stdout, runs.stdout


def test_an_os_error_ending_a_run_is_journaled_as_itself_not_as_a_bug():
    from rlm.core.drive import _RunEnd
    end = _RunEnd()
    end.failed(PermissionError(13, "Permission denied", "/nonexistent/.cache"))
    assert end.status == "failed" and isinstance(end.raised, PermissionError)
    assert end.reason == "Permission denied (/nonexistent/.cache)"
    end = _RunEnd()
    end.failed(ValueError("a bug"))
    assert end.reason.startswith("internal error: ValueError")


# --------------------------------------------------------------------------- the sandbox


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
def test_a_kernel_that_cannot_start_under_its_memory_cap_names_the_cap():
    """How much address space a kernel needs to start varies from run to run (each thread's
    malloc arena reserves some), so the cap here is far below any that could work."""
    from kernels.bwrap import SandboxSpec
    from kernels.kernel import Kernel
    k = Kernel(sandbox=SandboxSpec(mode="required", memory_mb=96), start_timeout=10)
    with pytest.raises(RuntimeError) as err:
        k.start()
    k.shutdown()
    text = str(err.value)
    assert text.startswith(("the Jupyter kernel exited while starting",
                            "the Jupyter kernel did not start within 10 s")), text
    assert "96 MiB" in text and "--kernel-memory" in text and "default is 4096" in text, text
    # at the default cap the hint would mislead: it is not given
    k = Kernel(sandbox=SandboxSpec(mode="required"))
    k.sandbox_mode = "bwrap"
    assert "--kernel-memory" not in k._start_failure(died=True)


def test_a_memory_cap_no_kernel_could_start_with_is_refused(cli, ctx_file):
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--kernel-memory", "64")
    assert_clean_error(res, 2, "--kernel-memory must be >= 256")


# --------------------------------------------------------------------------- extras, replay


def test_ray_not_installed_gives_the_install_command_not_a_cluster_hint(cli, tmp_path):
    shim = tmp_path / "shim" / "ray"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    res = cli("eval", "--tasks", "niah_single_2", "--lengths", "1k", "--n", "1", "--out",
              str(tmp_path / "out"), "--ray", "127.0.0.1:1",
              env={"PYTHONPATH": f"{tmp_path / 'shim'}:{REPO}"})
    assert_clean_error(res, 2, "--ray needs Ray", r"pip install")
    assert "ray start" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_replay_of_a_failed_run_says_it_failed_and_how_to_finish_it(cli, scripted, ctx_file):
    srv = scripted(lambda req: Reply(status=401, content="invalid api key"))
    args = ["run", "--context", str(ctx_file), "--query", "q", "--run-id", "down-1",
            *endpoint_args(srv)]
    assert cli(*args).rc == 3
    res = cli("replay", "down-1")
    assert_clean_error(res, 6, "the run ended failed", "HTTP 401", "rlm resume down-1")
    assert "took a different path" not in res.stderr


# --------------------------------------------------------------------------- paths and flags


def test_symlinks_that_lead_nowhere_say_so(cli, tmp_path):
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.txt")
    res = cli("run", "--context", str(tmp_path / "loop-a"), "--query", "q")
    assert_clean_error(res, 2, "symlink loop", "loop-a")
    res = cli("run", "--context", str(tmp_path / "dangling"), "--query", "q")
    assert_clean_error(res, 2, "symlink to a missing file", "gone.txt")
    res = cli("run", "--context", str(tmp_path / "nothing.txt"), "--query", "q")
    assert_clean_error(res, 2, "context file not found")


def test_a_mistyped_flag_is_named_by_its_command_in_two_lines(cli, ctx_file):
    for args, prog in ((["run", "--context", str(ctx_file), "--bogus"], "rlm run"),
                       (["resume", "some-id", "--bogus"], "rlm resume"),
                       (["eval", "--bogus"], "rlm eval"), (["--bogus"], "rlm")):
        res = cli(*args)
        assert res.rc == 2, res.stderr
        assert res.stderr.splitlines() == [f"{prog}: error: unrecognized arguments: --bogus",
                                           f"(`{prog} --help` lists its flags)"], res.stderr
    res = cli("run", "--context", str(ctx_file), "--max-iterations", "many")
    assert res.rc == 2 and len(res.stderr.splitlines()) == 2 and "invalid int" in res.stderr


def test_an_empty_query_is_refused_and_version_prints(cli, scripted, ctx_file):
    srv = _final(scripted)
    for q in ("", "   "):
        res = cli("run", "--context", str(ctx_file), "--query", q, *endpoint_args(srv))
        assert_clean_error(res, 2, "--query is empty")
    assert srv.count == 0
    res = cli("--version")
    assert res.rc == 0 and res.stdout.startswith("rlm "), res


def test_an_out_that_is_a_file_is_refused(cli, ctx_file):
    res = cli("eval", "--tasks", "niah_single_2", "--lengths", "1k", "--out", str(ctx_file))
    assert_clean_error(res, 2, "is a file", "give a directory")
