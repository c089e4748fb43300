"""The embedded model's server: llama.cpp on loopback, in a child process.

:class:`EmbeddedServer` runs llama.cpp's own HTTP server (through the prebuilt
``xllamacpp`` wheel) on ``127.0.0.1`` and hands back an OpenAI base URL.

Why a child process: ``xllamacpp.Server`` runs llama.cpp's server inside the calling
process, but its constructor holds the GIL for the whole model load (every Python
thread of the host freezes meanwhile), llama.cpp writes its logs straight to file
descriptors 1 and 2 (no Python redirect reaches them), it reports every load failure
as the same bare ``RuntimeError``, a native abort would take the host (and its
journal) down with it, and the only way to stop it is to drop the last reference.
So :class:`EmbeddedServer` starts a small Python child that owns the
``xllamacpp.Server``: its logs go to a file, a start deadline can be enforced from
outside, and a stop is "close the child's stdin" (the child also exits by itself when
the host dies, since its stdin then reads EOF). The child gets the host's environment
minus every secret-named variable (:func:`kernels.secrets.without_secrets`).
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import secrets
import select
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Union

from kernels.secrets import without_secrets
from rlm.errors import ConfigError, EmbeddedModelUnavailable, EndpointError, install_hint

from rlm.models.embedded.weights import DEFAULT_MODEL, ModelSpec, _spec, assemble_weights

__all__ = ["XLLAMACPP_INSTALL", "DEFAULT_SLOTS", "PARAMS", "EmbeddedServer", "LogTarget",
           "default_threads"]

#: Install command for the serving engine alone (the weights come with the extras).
XLLAMACPP_INSTALL = install_hint("embedded")

#: Request slots when none are asked for: concurrent sub-calls of one run are decoded together.
DEFAULT_SLOTS = 2

# How the child fills llama.cpp's parameters from the settings line (a function, so a test can
# apply it to a real xllamacpp.CommonParams without loading a model).
PARAMS = r"""
def fill_params(p, cfg):
    p.model.path = cfg["model_path"]
    p.model_alias = {cfg["alias"]}
    p.api_keys = [cfg["api_key"]]
    p.hostnames = ["127.0.0.1"]
    p.port = 0                      # llama.cpp binds a free port itself and reports it
    p.n_ctx = cfg["n_ctx_total"]    # KV pool, split evenly: n_ctx_total / n_parallel per slot
    p.n_parallel = cfg["n_parallel"]
    p.kv_unified = False            # fixed per-slot windows: one request cannot starve another
    p.cont_batching = True
    p.ctx_shift = False             # an over-long prompt is an error, never silently truncated
    p.cpuparams.n_threads = cfg["threads"]
    p.cpuparams_batch.n_threads = cfg["threads"]
    p.use_jinja = True              # chat template: the one inside the GGUF
    p.chat_template = ""
    p.fit_params = False            # sizes are explicit; fitting loads the model twice (0.5B: 4.3 s vs 0.8 s)
    p.warmup = True                 # one empty decode at load: ~0.03 s on the 0.5B
    p.cache_ram_mib = cfg["cache_ram_mib"]
    p.sleep_idle_seconds = -1
    p.verbosity = cfg["verbosity"]
    return p
"""

# The child process. Reads one JSON line of settings from stdin, starts the llama.cpp
# server, reports its address (or the error) on the handshake fd, then blocks reading
# stdin: EOF (the parent closed it, or died) or SIGTERM stops the server and exits.
_CHILD = r"""# rlm.models.embedded: the llama.cpp server child (see EmbeddedServer)
import json, os, signal, sys
cfg = json.loads(sys.stdin.readline())
hs = os.fdopen(cfg["handshake_fd"], "w")
def report(**kw):
    hs.write(json.dumps(kw) + "\n"); hs.flush(); hs.close()
try:
    import xllamacpp as xlc
except Exception as e:
    report(error="import", message=f"{type(e).__name__}: {e}"); sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
""" + PARAMS + r"""
p = fill_params(xlc.CommonParams(), cfg)
try:
    server = xlc.Server(p)
except Exception as e:
    report(error="start", message=f"{type(e).__name__}: {e}"); sys.exit(4)
report(address=server.listening_address)
try:
    while sys.stdin.buffer.read(4096):
        pass
finally:
    server = None               # xllamacpp stops only when the object is freed
"""

LogTarget = Union[str, os.PathLike, IO]


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads(cpus: int | None = None) -> int:
    """The embedded server's compute threads when none are asked for: the usable CPU cores
    minus one (``cpus``, default this process's), and 1 on a 1-core machine.

    Why one fewer: the host runs the kernels (the model's code, a second trial) beside the
    server, and llama.cpp's threads wait on each other at every step, so one thread sharing
    its core with a kernel stalls them all. Measured on a 2-core machine with a kernel busy:
    decode fell to 0.5-1.9 tokens/s with 2 threads and stayed at 5-16 with 1; a needle run
    took 52 s instead of 96 s, with the same answer.
    """
    cpus = _cpu_count() if cpus is None else cpus
    return max(1, cpus - 1)


class EmbeddedServer:
    """A llama.cpp server for one embedded model, on ``127.0.0.1``, in a child process.

    Use as a context manager (``with EmbeddedServer() as srv:``) or call :meth:`start`
    and :meth:`stop`. Clients talk to it with the ``openai`` client::

        OpenAI(base_url=srv.base_url, api_key=srv.api_key).chat.completions.create(
            model=srv.model_name, messages=[...])

    Requests need ``api_key`` (a random token made per server, so code running in a
    kernel cannot reach the model behind the host's back); ``/health`` is public.

    Settings for a small CPU box: ``threads`` compute threads (default
    :func:`default_threads`: the CPUs this process may run on, minus one for the kernels),
    ``parallel`` request slots (default 2, so concurrent sub-calls are served together by
    continuous batching), each slot with its own window of ``n_ctx`` tokens (llama.cpp
    divides its KV pool evenly among slots, so the pool is ``n_ctx * parallel``), the chat
    template stored in the GGUF, and quiet logs.

    Args:
        model: a key of :data:`~rlm.models.embedded.weights.MODELS` (default ``"qwen2.5-coder-0.5b"``)
            or a ModelSpec.
        n_ctx: context window per request, in tokens (prompt + completion); default the
            model's ``ctx_per_slot``; at most its trained length.
        threads: CPU threads for prefill and decode; default :func:`default_threads`.
        cache_dir: where assembled weights go; default :func:`default_cache_dir`.
        log: where llama.cpp's log goes (info level): a path (appended to) or an open
            file with a real file descriptor. Default None: errors only, kept in a temp
            file and quoted if the server fails to start.
        parallel: number of request slots (>= 1); None: :data:`DEFAULT_SLOTS`.
        startup_timeout: seconds to wait for the server to load and answer ``/health``.
        cache_ram_mib: host RAM for llama.cpp's prompt cache, in MiB (default 1024;
            llama.cpp's own default is 8192).

    Raises:
        ConfigError: an unknown model or an out-of-range setting (at construction).
    """

    def __init__(
        self,
        model: str | ModelSpec = DEFAULT_MODEL,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        cache_dir: Path | str | None = None,
        log: LogTarget | None = None,
        parallel: int | None = None,
        startup_timeout: float = 120.0,
        cache_ram_mib: int = 1024,
    ) -> None:
        self.spec: ModelSpec = _spec(model)
        self.n_ctx: int = int(n_ctx) if n_ctx is not None else self.spec.ctx_per_slot
        self.threads: int = int(threads) if threads is not None else default_threads()
        self.parallel: int = int(parallel) if parallel is not None else DEFAULT_SLOTS
        if not 16 <= self.n_ctx <= self.spec.n_ctx_train:
            raise ConfigError(
                f"n_ctx={self.n_ctx} is out of range for {self.spec.name!r}: "
                f"16..{self.spec.n_ctx_train} tokens per request"
            )
        if self.threads < 1 or self.parallel < 1:
            raise ConfigError(f"threads and parallel must be >= 1 (got {self.threads}, {self.parallel})")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.startup_timeout = float(startup_timeout)
        self.cache_ram_mib = int(cache_ram_mib)
        self._log = log
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._errlog: IO[bytes] | None = None
        self._base_url: str | None = None
        self._api_key = secrets.token_urlsafe(24)
        self.weights_path: Path | None = None
        #: seconds the last :meth:`start` took to spawn, load and pass the health check
        #: (after the weights were found and verified).
        self.startup_seconds: float | None = None

    # -- properties

    @property
    def model_name(self) -> str:
        """The model name to send in requests (the registry key, e.g. ``"qwen2.5-coder-0.5b"``)."""
        return self.spec.name

    @property
    def base_url(self) -> str:
        """The OpenAI base URL ``http://127.0.0.1:PORT/v1``.

        Raises:
            RuntimeError: the server is not running (never started, or stopped).
        """
        if self._base_url is None:
            raise RuntimeError("the embedded server is not running: call start() first")
        return self._base_url

    @property
    def port(self) -> int:
        """The TCP port the server listens on (127.0.0.1). Raises RuntimeError if not running."""
        return int(self.base_url.rsplit(":", 1)[1].split("/", 1)[0])

    @property
    def api_key(self) -> str:
        """The bearer token this server accepts (random, made per instance)."""
        return self._api_key

    @property
    def running(self) -> bool:
        """True while the child process is alive and :meth:`stop` has not been called."""
        with self._lock:
            return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the server child, or None when not running."""
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    # -- lifecycle

    def start(self) -> str:
        """Verify the weights, start the server and wait until it is healthy.

        Idempotent: a running server returns its URL again.

        Returns:
            The OpenAI base URL, ``http://127.0.0.1:PORT/v1``.

        Raises:
            EmbeddedModelUnavailable: ``xllamacpp`` or the weight packages are not
                installed (message has the pip command), or the weights fail the hash check.
            EndpointError: the server did not come up within ``startup_timeout`` seconds,
                or exited while starting (message quotes the end of its log).
            OSError: the cache directory cannot be written.
        """
        with self._lock:
            if self.running and self._base_url is not None:
                return self._base_url
            self._cleanup()
            if importlib.util.find_spec("xllamacpp") is None:
                raise EmbeddedModelUnavailable(
                    f"the embedded model needs xllamacpp, which is not installed: {XLLAMACPP_INSTALL}"
                )
            self.weights_path = assemble_weights(self.spec, self.cache_dir)
            t0 = time.monotonic()
            try:
                self._base_url = self._spawn(t0 + self.startup_timeout)
            except BaseException:
                self._kill()
                self._cleanup()
                raise
            self.startup_seconds = time.monotonic() - t0
            atexit.register(self.stop)
            return self._base_url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and wait for its process to exit. Idempotent, never raises.

        Closes the child's stdin (it frees the llama.cpp server, which closes the port,
        and exits; ~0.1 s); escalates to SIGTERM, then SIGKILL, if it has not exited
        within ``timeout`` seconds.

        Args:
            timeout: seconds to wait for a clean exit before escalating.
        """
        with self._lock:
            proc = self._proc
            if proc is not None:
                try:
                    if proc.stdin is not None:
                        proc.stdin.close()
                except OSError:
                    pass
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._cleanup()
            try:
                atexit.unregister(self.stop)
            except Exception:
                pass

    def __enter__(self) -> "EmbeddedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self._base_url if self.running else "stopped"
        return f"<EmbeddedServer {self.spec.name} n_ctx={self.n_ctx}x{self.parallel} {state}>"

    def child_settings(self, verbose: bool = False) -> dict:
        """The settings line the server child reads (JSON; its handshake fd left out) and
        applies with ``fill_params`` (:data:`PARAMS`): ``model_path`` (the weights once
        :meth:`start` found them, else None), ``alias``, ``api_key``, ``n_ctx_total``
        (tokens: ``n_ctx * parallel``), ``n_parallel`` (slots), ``threads``,
        ``cache_ram_mib`` (MiB) and ``verbosity`` (3 = info with ``verbose``, else 1 = errors)."""
        return {
            "model_path": None if self.weights_path is None else str(self.weights_path),
            "alias": self.spec.name,
            "api_key": self._api_key,
            "n_ctx_total": self.n_ctx * self.parallel,
            "n_parallel": self.parallel,
            "threads": self.threads,
            "cache_ram_mib": self.cache_ram_mib,
            "verbosity": 3 if verbose else 1,
        }

    # -- internals

    def _log_target(self) -> tuple[int | IO, bool]:
        """(file or fd for the child's stdout/stderr, verbose?)."""
        if self._log is None:
            self._errlog = tempfile.TemporaryFile(prefix="rlm-embedded-", suffix=".log")
            return self._errlog, False
        if isinstance(self._log, (str, os.PathLike)):
            path = Path(self._log).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._errlog = open(path, "ab")
            return self._errlog, True
        try:
            return self._log.fileno(), True
        except (AttributeError, OSError, ValueError) as e:
            raise ConfigError(
                "log must be a path or an open file with a real file descriptor"
            ) from e

    def _log_tail(self, limit: int = 2000) -> str:
        f = self._errlog
        if f is None:
            return ""
        try:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - limit)
            text = os.pread(f.fileno(), size - start, start).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return "\n".join(lines[-12:])

    def _spawn(self, deadline: float) -> str:
        out, verbose = self._log_target()
        env = without_secrets()  # the child needs no credentials
        r_fd, w_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                pass_fds=(w_fd,),
                env=env,
                start_new_session=True,  # a terminal Ctrl-C goes to the host, which stops us
            )
        finally:
            os.close(w_fd)
        try:
            cfg = {**self.child_settings(verbose), "handshake_fd": w_fd}
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(cfg) + "\n").encode())
            self._proc.stdin.flush()
            reply = self._read_handshake(r_fd, deadline)
        finally:
            os.close(r_fd)
        if "address" not in reply:
            message = reply.get("message", "no reply")
            if reply.get("error") == "import":
                raise EmbeddedModelUnavailable(
                    f"xllamacpp is installed but cannot be imported ({message}): {XLLAMACPP_INSTALL}"
                )
            try:  # it exits right after reporting: then its log is complete, and quoted
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            raise EndpointError(self._failure(f"the llama.cpp server failed to start ({message})"))
        address = str(reply["address"]).rstrip("/")
        if not address.startswith("http://127.0.0.1:"):
            raise EndpointError(self._failure(f"the server listens on an unexpected address {address!r}"))
        self._wait_healthy(address, deadline)
        return address + "/v1"

    def _read_handshake(self, fd: int, deadline: float) -> dict:
        data = b""
        proc = self._proc
        assert proc is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EndpointError(self._failure(
                    f"the embedded server did not start within {self.startup_timeout:.0f} s"
                ))
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.25))
            if ready:
                chunk = os.read(fd, 65536)
                data += chunk
                if not chunk or b"\n" in data:
                    break
            elif proc.poll() is not None:
                break
        try:
            return json.loads(data.decode().splitlines()[0]) if data.strip() else {}
        except ValueError:
            return {"error": "protocol", "message": data[:200].decode("utf-8", "replace")}

    def _wait_healthy(self, address: str, deadline: float) -> None:
        last = "no answer"
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise EndpointError(self._failure("the embedded server exited while starting"))
            try:
                with urllib.request.urlopen(address + "/health", timeout=2) as resp:
                    if resp.status == 200 and json.loads(resp.read()).get("status") == "ok":
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"  # 503 while loading
            except (OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EndpointError(self._failure(
                    f"the embedded server at {address} was not healthy within "
                    f"{self.startup_timeout:.0f} s (last: {last})"
                ))
            time.sleep(0.05)

    def _failure(self, what: str) -> str:
        code = self._proc.poll() if self._proc is not None else None
        msg = f"{what}; model {self.spec.name!r} from {self.weights_path}"
        if code is not None:
            msg += f", exit code {code}"
        tail = self._log_tail()
        if tail:
            msg += f". Last log lines:\n{tail}"
        elif self._log is not None:
            msg += f". See the log at {self._log}"
        return msg

    def _kill(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig in (proc.terminate, proc.kill):
            try:
                sig()
                proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue
            except OSError:
                return

    def _cleanup(self) -> None:
        proc, self._proc = self._proc, None
        self._base_url = None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        if self._errlog is not None:
            try:
                self._errlog.close()
            except OSError:
                pass
            self._errlog = None
