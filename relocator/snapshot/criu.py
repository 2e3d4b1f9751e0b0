"""The one wrapper around the CRIU binary: version, check, dump and restore of a cell's tree,
and the long-running helpers of the streamed and post-copy transfers (page server, lazy dump,
lazy-pages daemon)."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from relocator.ports import free_port

MIN_VERSION = (4, 2)
NETNS_KEY = "cellnet"  # label of the cell's network namespace, external to the image


class CriuError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message + (f"\n--- criu log (last lines) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


def criu_binary() -> str:
    for cand in (os.environ.get("RELOCATOR_CRIU"), "/usr/local/sbin/criu", shutil.which("criu")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise CriuError("CRIU not found: run scripts/install-criu.sh (CRIU >= 4.2 is required)")


@lru_cache(maxsize=4)
def criu_version(binary: str | None = None) -> str:
    binary = binary or criu_binary()
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"Version:\s*(\S+)", out)
    if not m:
        raise CriuError(f"cannot read the version of {binary}: {out.strip()!r}")
    return m.group(1)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "Error" in line or "error" in line]
    return "\n".join((errors or text)[-lines:])


@dataclass
class DumpResult:
    seconds: float


def _dump_cmd(pid: int, image_dir: Path, netns_inode: int, leave_stopped: bool,
              extra_args: Sequence[str], leave_running: bool = False) -> list[str]:
    cmd = [
        criu_binary(), "dump", "-t", str(pid), "-D", str(image_dir), "-o", "dump.log", "-v2",
        "--tcp-established", "--link-remap", "--manage-cgroups=ignore",
        # A connection still waiting in a listen queue (a health probe or scrape sent straight
        # to the worker at that instant) would otherwise fail the whole dump; it is dropped.
        "--skip-in-flight",
        "--external", f"net[{netns_inode}]:{NETNS_KEY}",
    ]
    if leave_stopped:
        cmd.append("--leave-stopped")
    elif leave_running:  # the tree goes on running once dumped (a warm image: relocator.warm.capture)
        cmd.append("--leave-running")
    return cmd + list(extra_args)  # e.g. a GPU cell's driver mounts, external (devices.criu_external_args)


def dump(pid: int, image_dir: Path, netns_inode: int, leave_stopped: bool = True,
         extra_args: Sequence[str] = (), page_server: tuple[str, int] | int | None = None,
         leave_running: bool = False, tls_dir: str | None = None) -> DumpResult:
    """Checkpoint the tree rooted at host `pid` into `image_dir`.

    The cell's network namespace is marked external (it is recreated on the target, with its own
    address), so only the sockets go into the image. The tree is left stopped, not killed
    (`leave_running`, with leave_stopped False: it goes on running).
    `page_server` (address, port): the memory pages (pagemap and pages images) go straight to
    that page server as they are read (`criu page-server` on the target), over TLS with the
    cluster's certificates (relocator.credentials); only the other, small images are written
    to `image_dir`. An int: a connected unix socket to a page server of this host instead,
    passed with `--ps-socket`, plaintext (the kernel authenticated its ends).
    `tls_dir`: the move's own credentials (relocator.credentials.install_move) instead of the
    node's: the target's front admits only them.
    """
    image_dir.mkdir(parents=True, exist_ok=True)
    cmd = _dump_cmd(pid, image_dir, netns_inode, leave_stopped, extra_args, leave_running)
    fds: tuple[int, ...] = ()
    if isinstance(page_server, int):  # a unix socket to a page server on this host: no crypto
        cmd += ["--page-server", "--ps-socket", str(page_server)]  # (relocator.agent.locallink)
        fds = (page_server,)
    elif page_server is not None:  # TLS, both ends authenticated by the cluster's CA
        cmd += ["--page-server", "--address", page_server[0], "--port", str(page_server[1]), *_tls(tls_dir)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, pass_fds=fds)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise CriuError(f"criu dump of pid {pid} failed (exit {proc.returncode})", _log_tail(image_dir / "dump.log"))
    return DumpResult(seconds=took)


def restore(image_dir: Path, netns_path: str, pidfile: Path, log_dir: Path,
            extra_args: Sequence[str] = (), lazy: bool = False) -> int:
    """Restore the tree from `image_dir` into the network namespace at `netns_path`.

    Runs CRIU inside a throw-away private mount namespace with `/` bound as its root (CRIU
    4.2.1 needs --root for a tree with its own mount namespace). Established TCP connections
    are restored closed: they belonged to clients of the old place, and the engine then aborts
    the requests they carried instead of decoding for nobody. Returns the host PID of the
    restored tree's init; the tree is detached (not our child).

    `lazy`: post-copy (`--lazy-pages`): the memory the image left out is registered with
    userfaultfd and handed to the `criu lazy-pages` daemon already listening in `log_dir`
    (`lazy_pages()`), which fills it from the source's page server on demand and in the
    background; the tree runs before its memory has arrived.
    """
    pidfile.unlink(missing_ok=True)  # an existing pidfile makes CRIU kill what it restored
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "restore.log"
    root_bind = Path(tempfile.mkdtemp(prefix="relocator-restore-root-", dir="/run"))
    criu = [
        criu_binary(), "restore", "-D", str(image_dir), "-W", str(log_dir), "-o", str(log), "-v2",
        "--root", str(root_bind), "-d", "--tcp-close", "--manage-cgroups=ignore",
        "--pidfile", str(pidfile), "--inherit-fd", f"fd[7]:{NETNS_KEY}", *extra_args,
    ]
    if lazy:
        criu.append("--lazy-pages")
    script = 'mount --bind / "$0" && exec 7<"$1" && shift && exec "$@"'
    try:
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(root_bind), netns_path, *criu],
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )
    finally:
        try:
            root_bind.rmdir()
        except OSError:
            pass
    if proc.returncode != 0 or not pidfile.exists():
        raise CriuError(f"criu restore from {image_dir} failed (exit {proc.returncode}) {proc.stderr.strip()}",
                        _log_tail(log))
    return int(pidfile.read_text().strip())


def unlock_network(netns: str) -> None:
    """Drop the packet filter CRIU leaves in a namespace whose tree was dumped and left stopped."""
    script = (
        "iptables -D INPUT -j CRIU; iptables -D OUTPUT -j CRIU; iptables -F CRIU; iptables -X CRIU; "
        "nft delete table inet CRIU"
    )
    subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", script], capture_output=True)


# -- transfer helpers: page server, lazy dump, lazy-pages daemon, kernel features ----------------
#: CRIU's page server tees up to PIPE_MAX_SIZE (819 pages, ~3.2 MiB) per request into a pipe it
#: grows with F_SETPIPE_SZ; without CAP_SYS_RESOURCE the kernel caps that at fs.pipe-max-size
#: (1 MiB by default) and CRIU (4.2.1) ignores the failure, then fails the first large request
#: of a lazy dump with "tee: 65536: Operation not permitted".
LAZY_PIPE_BYTES = 4 << 20
CAP_SYS_RESOURCE = 24


@lru_cache(maxsize=16)
def feature(name: str) -> tuple[bool, str]:
    """`criu check --feature NAME`: (supported, CRIU's words)."""
    try:
        binary = criu_binary()
    except CriuError as exc:
        return False, str(exc)
    proc = subprocess.run([binary, "check", "--feature", name], capture_output=True, text=True)
    out = " ".join((proc.stdout + proc.stderr).split())
    bad = proc.returncode != 0 or re.search(r"not supported|is OFF|unsupported|Error", out)
    return (not bad), out or f"exit {proc.returncode}"


def lazy_dump_pipes() -> tuple[bool, str]:
    """Whether a lazy dump (the source of a post-copy) can serve large page requests here."""
    from relocator import procs  # here, not at the top: the keeper imports this module under -S

    if procs.has_capability(CAP_SYS_RESOURCE):
        return True, "CAP_SYS_RESOURCE (pipes of any size)"
    try:
        size = int(procs.sysctl("fs.pipe-max-size") or "")
    except ValueError:
        return False, "fs.pipe-max-size unreadable"
    ok = size >= LAZY_PIPE_BYTES
    return ok, (f"fs.pipe-max-size is {size} (>= {LAZY_PIPE_BYTES} needed without CAP_SYS_RESOURCE)")


class CriuProcess:
    """A long-running CRIU command (page server, lazy dump, lazy-pages daemon) started in its
    own session, so that it outlives the agent that started it and no signal to the agent's
    group reaches it. `start()` returns once CRIU reports itself ready on --status-fd (listening,
    or connected and waiting), or raises CriuError with its log if it exits first."""

    def __init__(self, argv: list[str], log: Path, what: str, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None, pass_fds: Sequence[int] = ()) -> None:
        self.argv, self.log, self.what, self.cwd, self.env = argv, Path(log), what, cwd, env
        self.pass_fds = tuple(pass_fds)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> "CriuProcess":
        r, w = os.pipe()
        out = open(self.log.with_suffix(".out"), "ab")
        try:
            self.proc = subprocess.Popen(self.argv + ["--status-fd", str(w)], pass_fds=(w, *self.pass_fds),
                                         stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=out, cwd=self.cwd, env=self.env,
                                         start_new_session=True)
        finally:
            os.close(w)
            out.close()
        self.started = time.monotonic()
        try:
            ready, _, _ = select.select([r], [], [], timeout)
            got = os.read(r, 1) if ready else None
        finally:
            os.close(r)
        if got == b"\0":
            return self
        if got is None:
            self.kill()
            raise CriuError(f"criu {self.what} not ready within {timeout:.0f}s", _log_tail(self.log))
        rc = self.proc.wait()
        raise CriuError(f"criu {self.what} exited before it was ready (exit {rc})", _log_tail(self.log))

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises subprocess.TimeoutExpired after `timeout`."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def log_tail(self) -> str:
        return _log_tail(self.log)


def _start_on_free_port(make: Callable[[int], CriuProcess], address: str, tries: int = 4) -> CriuProcess:
    last: CriuError | None = None
    for _ in range(tries):  # a port taken between free_port() and CRIU's bind: try another
        try:
            return make(free_port(address)).start()
        except CriuError as exc:
            last = exc
            if "in use" not in str(exc):
                raise
    assert last is not None
    raise last


def _tls(directory: str | None = None) -> list[str]:
    """CRIU's TLS options with this node's credentials, or a move's (`directory`);
    CredentialsError if it has none."""
    from relocator.credentials import criu_tls_args

    return criu_tls_args(directory)


def page_server(image_dir: Path, address: str, port: int = 0) -> tuple[CriuProcess, int]:
    """`criu page-server` writing the pages a remote dump sends into `image_dir` (one session:
    it exits when the dump disconnects, 0 once every page was flushed). Returns it and its port.
    TLS: only a dump holding a certificate of the cluster's CA gets through the handshake; any
    other connection ends the page server (and so the move) without a byte of memory."""
    image_dir.mkdir(parents=True, exist_ok=True)
    tls = _tls()

    def make(p: int) -> CriuProcess:
        proc = CriuProcess([criu_binary(), "page-server", "-D", str(image_dir), "-o", "page-server.log", "-v2",
                            "--address", address, "--port", str(p), *tls], image_dir / "page-server.log",
                           "page-server")
        proc.port = p  # type: ignore[attr-defined]
        return proc

    proc = make(port).start() if port else _start_on_free_port(make, address)
    return proc, proc.port  # type: ignore[attr-defined]


def page_server_on(image_dir: Path, sock: int) -> CriuProcess:
    """`criu page-server` on a connected unix socket (`--ps-socket`) to a dump of this host,
    authenticated by the kernel (relocator.agent.locallink): no TLS, no listening port."""
    image_dir.mkdir(parents=True, exist_ok=True)
    return CriuProcess([criu_binary(), "page-server", "-D", str(image_dir), "-o", "page-server.log", "-v2",
                        "--ps-socket", str(sock)], image_dir / "page-server.log", "page-server",
                       pass_fds=(sock,)).start()


def lazy_dump(pid: int, image_dir: Path, netns_inode: int, address: str, port: int = 0,
              extra_args: Sequence[str] = (), ps_socket: int | None = None) -> tuple[CriuProcess, int]:
    """The source side of a post-copy: `criu dump --lazy-pages`. Returns once every image but
    the lazy memory is written to `image_dir` and CRIU listens on address:port; the tree stays
    frozen while this process serves its memory to the target's lazy-pages daemon. It exits 0
    when the daemon has every page (the tree is then left stopped), non-zero if the transfer
    broke (the tree is then let run again: resume_source still has to unlock its network).
    `ps_socket`: serve on that connected socket instead (one end of a socket pair whose other
    end a TLS front holds, relocator.agent.front): no port, no TLS in CRIU; returns port 0."""
    image_dir.mkdir(parents=True, exist_ok=True)
    if ps_socket is not None:
        cmd = _dump_cmd(pid, image_dir, netns_inode, True, extra_args)
        proc = CriuProcess(cmd + ["--lazy-pages", "--ps-socket", str(ps_socket)], image_dir / "dump.log",
                           "dump --lazy-pages", pass_fds=(ps_socket,))
        return proc.start(), 0
    tls = _tls()  # the keeper on the target is the only client that gets through

    def make(p: int) -> CriuProcess:
        cmd = _dump_cmd(pid, image_dir, netns_inode, True, extra_args)
        proc = CriuProcess(cmd + ["--lazy-pages", "--address", address, "--port", str(p), *tls],
                           image_dir / "dump.log", "dump --lazy-pages")
        proc.port = p  # type: ignore[attr-defined]
        return proc

    proc = make(port).start() if port else _start_on_free_port(make, address)
    return proc, proc.port  # type: ignore[attr-defined]


def lazy_pages(image_dir: Path, work_dir: Path, address: str = "", port: int = 0, log: Path | None = None,
               ps_socket: int | None = None) -> CriuProcess:
    """`criu lazy-pages`: waits in `work_dir` for `restore(lazy=True)` to hand it the restored
    tree's userfaultfds, then fills the missing memory from the page server at address:port, or
    on the connected socket `ps_socket` (passed down; the keeper's socket pair), a fault first,
    everything else in the background, and exits once all of it has arrived."""
    log = log or work_dir / "lazy-pages.log"
    where = ["--ps-socket", str(ps_socket)] if ps_socket is not None else ["--address", address, "--port", str(port)]
    return CriuProcess([criu_binary(), "lazy-pages", "--page-server", *where,
                        "-D", str(image_dir), "-W", str(work_dir), "-o", str(log), "-v2"], log, "lazy-pages",
                       pass_fds=() if ps_socket is None else (ps_socket,)).start()
