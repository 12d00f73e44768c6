"""The sandbox supervisor (`envs/sandbox.py`): the one function that runs, on its own, in a fresh
interpreter under the caller's privileges. The supervisor never imports this module: its source is
compiled once here (`SUPERVISOR_CODE`) and sandbox.py ships the code with each job, so `supervise` must
stay self-contained (its imports inside it)."""

import inspect
import marshal


def supervise(job: dict) -> None:
    """The supervisor, run by `BOOTSTRAP` with the caller's privileges: builds the isolation, runs
    the program, and writes to the status pipe (fd in argv[1]) a line `returncode N` (-N: killed by
    signal N) or `error <why>`. Self-contained, and its imports stay few and cheap (no json, re or
    signal): each costs every run."""
    import _signal as signal  # the C module: `signal` imports enum and costs ~6 ms
    import ctypes
    import os
    import resource
    import sys

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
    MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
        0x20000,
        0x4000000,
        0x8000000,
        0x10000000,
        0x20000000,
        0x40000000,
    )
    PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
    mode = job["mode"]  # namespaces (root's), user_namespaces, plain
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    status_fd = int(sys.argv[1])
    os.set_inheritable(status_fd, False)  # the program never holds it
    # If the caller's thread dies, SIGTERM makes this process empty the sandbox (on_term below).
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0 or os.getppid() != job["caller_pid"]:
        os._exit(1)  # the caller died before it could be watched: start nothing
    target = []  # the process that SIGTERM (the caller giving up) kills

    def report(kind, text):
        try:
            os.write(status_fd, f"{kind} {text}".replace("\n", " ").encode() + b"\n")
        except OSError:  # the caller is gone; the cleanup still has to happen
            pass

    if job["cgroup"]:  # before anything forks: every process of the run is limited and counted there
        try:
            with open(os.path.join(job["cgroup"], "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        except OSError as exc:
            report("error", f"joining the cgroup {job['cgroup']} failed: {exc!r}")
            os._exit(1)

    def check(result, what):
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def mount(source, path, fstype, flags, data=None):
        encode = lambda text: None if text is None else text.encode()  # noqa: E731
        check(libc.mount(encode(source), encode(path), encode(fstype), flags, encode(data)), f"mount {path}")

    def alive(pid, uid):
        """Whether process `pid` belongs to `uid` and is not a zombie."""
        try:
            with open(f"/proc/{pid}/status") as file:
                fields = dict(line.split(":", 1) for line in file if ":" in line)
        except OSError:  # gone already
            return False
        return fields["Uid"].split()[0] == str(uid) and fields["State"].split()[0] not in ("Z", "X")

    def sweep(uid):
        """Kill every process of the run's uid (plain mode): kill(-1) as that uid, until none is alive."""
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the supervisor's handler
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                me = str(os.getpid())
                while True:
                    try:
                        os.kill(-1, signal.SIGKILL)  # every process this uid may signal: its own
                    except ProcessLookupError:
                        pass
                    if not any(alive(entry, uid) for entry in os.listdir("/proc") if entry.isdigit() and entry != me):
                        break
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    def kill_target():
        if mode != "plain":
            for pid in target:  # the namespace's init: its death kills everything inside
                os.kill(pid, signal.SIGKILL)
        elif job.get("uid") is not None:
            sweep(job["uid"])
        else:  # no uid of its own: the process group is all there is to kill, this process included
            os.killpg(0, signal.SIGKILL)

    def on_term(signum, frame):
        stopping.append(signum)
        kill_target()

    def start(pid):
        target.append(pid)
        if stopping:  # the caller gave up before this process existed
            kill_target()

    stopping = []
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGALRM, on_term)  # a backstop for the wall-time limit, should the caller be stuck
    signal.setitimer(signal.ITIMER_REAL, job["backstop_s"])

    def remount_everything_read_only():
        with open("/proc/self/mountinfo") as mountinfo:
            entries = [line.split() for line in mountinfo]
        options = {
            "nodev": MS_NODEV,
            "noexec": MS_NOEXEC,
            "noatime": MS_NOATIME,
            "nodiratime": MS_NODIRATIME,
            "relatime": MS_RELATIME,
        }
        for fields in entries:
            path = fields[4]
            for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                path = path.replace(escaped, char)  # how mountinfo writes these four
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
            for option in fields[5].split(","):
                flags |= options.get(option, 0)
            mount(None, path, None, flags)

    def set_up_mounts():
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        remount_everything_read_only()
        empty = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        try:  # this namespace's processes only: the caller's /proc/<pid>/environ is not there to read
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        except OSError:  # a user namespace in a container whose /proc is partly masked: no /proc at all
            mount("tmpfs", "/proc", "tmpfs", empty, "size=4k,mode=555")
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['workdir_mb']}m,nr_inodes=16384,mode=755")
        # Private shared memory (multiprocessing's semaphores live there), gone with the namespace.
        if os.path.isdir("/dev/shm") and not os.path.islink("/dev/shm"):
            shm = f"size={job['workdir_mb']}m,mode=1777"
            mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, shm)
        # Daemons' sockets (a unix socket ignores read-only mounts) and, in a user namespace where the
        # program keeps the caller's uid, the caller's home (tokens, keys): empty and read-only.
        for path in ["/run", *job["hide"]]:
            if os.path.isdir(path) and not os.path.islink(path):
                mount("tmpfs", path, "tmpfs", empty, "size=4k,mode=755")
        os.mkdir(job["workdir"], 0o700)

    def enter_user_namespace():
        """Unshare every namespace under a new user namespace (no privilege needed), as a uid that is
        not root: the caller's, or (a root caller without CAP_SYS_ADMIN) the run's own uid."""
        uid = job["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            # A change of uid clears the parent-death signal and makes /proc/self root's: set both again.
            check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl")
            check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl")
            if os.getppid() != job["caller_pid"]:
                os._exit(1)
        euid, egid = os.geteuid(), os.getegid()
        if euid == 0:  # root inside would keep its capabilities there and could undo the mounts
            raise OSError(1, "user namespaces need a uid other than 0 to run programs as")
        check(libc.unshare(CLONE_NEWUSER | namespaces), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{euid} {euid} 1"), ("gid_map", f"{egid} {egid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)

    def prepare_workdir():
        workdir, uid = job["workdir"], job["uid"]
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as file:
            file.write(job["source"])
        if uid is not None:
            os.chown(workdir, uid, uid)

    def exec_program():
        """In the forked child: limits, privileges, exec. Never returns."""
        try:
            uid, workdir = job["uid"], job["workdir"]
            os.chdir(workdir)
            os.umask(0o077)
            for name, soft, hard in job["rlimits"]:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
            if uid is not None and mode != "user_namespaces":  # there it is the uid already
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            }
            python = job["python"]
            if mode != "plain":
                argv = [python, "-I", "-B", "main.py"]
            else:  # no network namespace: take sockets away before the program runs
                hook = (
                    "import socket, _socket, runpy\n"
                    "def _no_network(*args, **kwargs):\n"
                    "    raise PermissionError('network access is disabled in the sandbox')\n"
                    "socket.socket = _socket.socket = socket.socketpair = socket.create_connection = _no_network\n"
                    "del socket, _socket\n"
                    "runpy.run_path('main.py', run_name='__main__')\n"
                )
                argv = [python, "-I", "-B", "-c", hook]
            os.execve(python, argv, env)
        except BaseException as exc:
            report("error", f"starting the program failed: {exc!r}")
        finally:
            os._exit(127)

    def run_program():
        """Fork the program, reap every child until it exits, report its exit code."""
        program = os.fork()
        if program == 0:
            exec_program()
        start(program)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                report("returncode", os.waitstatus_to_exitcode(status))
                return

    def remove_tree(top):
        """Delete a directory (or a file) and what it holds; the uid that wrote it has no process left."""
        if not os.path.isdir(top) or os.path.islink(top):
            os.unlink(top)
            return
        for root, dirs, files in os.walk(top, topdown=False):
            for name in files + dirs:
                path = os.path.join(root, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
        os.rmdir(top)

    def remove_leftovers(uid):
        """Plain mode, as root: what the run's uid left in the shared scratch directories."""
        for shared in ("/tmp", "/var/tmp", "/dev/shm"):
            try:
                entries = list(os.scandir(shared))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        remove_tree(entry.path)
                except OSError:  # gone meanwhile
                    pass

    try:
        if mode == "plain":
            try:
                prepare_workdir()
                run_program()
            finally:  # also when the caller died: it will not delete the directory
                if job["uid"] is not None:
                    sweep(job["uid"])  # daemons the program left behind
                remove_tree(job["workdir"])
                if job["uid"] is not None:
                    remove_leftovers(job["uid"])
            return
        namespaces = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        if mode == "user_namespaces":
            enter_user_namespace()
        else:
            check(libc.unshare(namespaces), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
        init = os.fork()
        if init == 0:  # pid 1 of the new pid namespace: when it exits, the kernel kills the rest
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                target.clear()
                set_up_mounts()
                prepare_workdir()
                run_program()
            except BaseException as exc:
                report("error", f"setting up the sandbox failed: {exc!r}")
            finally:
                os._exit(0)
        start(init)
        os.waitpid(init, 0)  # returns once every process of the namespace is gone
    except Exception as exc:
        report("error", f"setting up the sandbox failed: {exc!r}")


# Compiling the supervisor costs more than starting Python, so the caller compiles it once, on import, and
# sends it marshalled (the supervisor runs the same interpreter) with the job, ahead of the program's stdin.
SUPERVISOR_CODE = marshal.dumps(compile(inspect.getsource(supervise), __file__, "exec"))
BOOTSTRAP = """import marshal, os
def read_exactly(size):
    data = b""
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            raise SystemExit("the sandbox job ended early")
        data += chunk
    return data
header = b""
while not header.endswith(b"\\n"):
    header += read_exactly(1)
code, job = marshal.loads(read_exactly(int(header)))
exec(marshal.loads(code))
supervise(job)
"""
