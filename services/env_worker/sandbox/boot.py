"""Runs inside the sandbox child process, before the untrusted program: `python -I boot.py CONFIG_JSON`.

Applies the limits to itself (so no `preexec_fn` is needed in a threaded parent; soft = hard, and raising a hard
limit needs CAP_SYS_RESOURCE, which no sandboxed program has), then executes `main.py` from the current
directory as `__main__`. Config `guard`: "kernel" (inside bubblewrap: the namespaces and seccomp are the
boundary, `site_packages` are added to sys.path since the interpreter runs with -S) or "hook" (mode `none`:
the Python audit hook below, a guard against accidents only). See services/env_worker/sandbox/__init__.py.
"""

import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
# Audit events that start processes: blocked outright (a fork bomb gets PermissionError on its first fork).
PROCESS_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
    "os.kill", "os.killpg", "pty.spawn",
}
FS_WRITE_EVENTS = {
    "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link",
    "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move",
}
LIST_EVENTS = {"os.listdir", "os.scandir", "glob.glob", "glob.glob/2"}
BLOCKED_IMPORTS = {"cffi", "_cffi_backend"}
# ctypes may be imported (numpy does) but not used to call native functions or touch raw memory.
CTYPES_EVENTS = {"ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.addressof",
                 "ctypes.string_at", "ctypes.wstring_at", "ctypes.set_errno", "ctypes.get_errno"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def isolate_network() -> bool:
    """New empty network namespace (only a down loopback): needs root or unprivileged user namespaces."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ok = libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    for name in ("ctypes", "_ctypes", "ctypes._endian"):
        sys.modules.pop(name, None)
    return ok


def set_limits(cfg: dict) -> None:
    cpu = int(cfg["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"], cfg["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_bytes"], cfg["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_procs"], cfg["max_procs"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def inside(path, root: str) -> bool:
    try:
        real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else f"/proc/self/fd/{path}")
    except (TypeError, ValueError):
        return False
    return real == root or real.startswith(root + os.sep) or real == os.devnull


def readable_roots(root: str) -> list[str]:
    """The sandbox dir, the Python installation (stdlib, site-packages: imports must work) and harmless devices.
    Anything else (the repo, /etc, other users' data, the worker's secrets) cannot be read or listed."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return [root, *sorted(os.path.realpath(p) for p in prefixes), "/dev/null", "/dev/urandom", "/dev/zero"]


def make_hook(root: str):
    readable = readable_roots(root)

    def hook(event: str, args: tuple) -> None:
        if event in PROCESS_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed (no new processes)")
        if event.startswith("socket.") or event in CTYPES_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed (no network, no native calls)")
        if event == "import" and args[0].partition(".")[0] in BLOCKED_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open" and args[0] is not None and not isinstance(args[0], int):
            if _writes(args) and not inside(args[0], root):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
            if not any(inside(args[0], r) for r in readable):
                raise PermissionError(f"sandbox: reading {args[0]!r} outside the sandbox directory is not allowed")
        if event in LIST_EVENTS and args[0] is not None and not isinstance(args[0], int) and not any(
                inside(args[0], r) for r in readable):
            raise PermissionError(f"sandbox: listing {args[0]!r} outside the sandbox directory is not allowed")
        if event in FS_WRITE_EVENTS and not all(inside(a, root) for a in args[:2] if isinstance(a, str | bytes)):
            raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed")

    return hook


def _writes(args: tuple) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def disable_fork_exec() -> None:
    """`_posixsubprocess.fork_exec` raises no audit event of its own: replace it (subprocess calls it)."""
    import _posixsubprocess

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: fork_exec is not allowed (no new processes)")

    _posixsubprocess.fork_exec = refuse


def main() -> None:
    cfg = json.loads(sys.argv[1])
    root = os.path.realpath(os.getcwd())
    if cfg.get("guard") == "kernel":
        set_limits(cfg)
        sys.argv = ["main.py"]
        sys.path[:0] = [root]
        sys.path.extend(cfg.get("site_packages", ()))
        source = open("main.py").read()
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py",
                                                  "__builtins__": __builtins__})
        return
    isolate_network()  # best effort; the audit hook blocks sockets either way
    source = open("main.py").read()
    set_limits(cfg)
    sys.argv = ["main.py"]
    sys.path[0] = root
    sys.addaudithook(make_hook(root))
    disable_fork_exec()
    code = compile(source, "main.py", "exec")
    exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
