"""The sandbox launcher: run as `python -I -S contain.py STATUS_FD` by
`jaxcorr.sandbox.runner`, never imported by the trainer.

Standard library only (it runs under `-I -S`, before and outside the
trainer's environment). It reads one JSON request from stdin, then:

1. asks the kernel to SIGKILL it when its parent dies (a killed reward
   worker leaves nothing running), and, when started as root, drops to
   `nobody` (65534) first: root's processes are exempt from RLIMIT_NPROC,
   and a user namespace made by an unprivileged uid maps only that uid;
2. `unshare`s new user, mount, network, PID, IPC and UTS namespaces: the
   network namespace has a loopback interface that is down and nothing
   else, so every connect fails at once (ENETUNREACH), the host's loopback
   services included;
3. builds a new root on a 1 MiB tmpfs: `/usr` (and the interpreter's
   prefix when it lives elsewhere) bind-mounted read-only, `/dev/null`,
   `zero`, `random`, `urandom`, `/etc/ld.so.cache`, and `/scratch`, a
   size-limited tmpfs holding the request's files; `pivot_root`s into it
   and detaches the old root, so the trainer's files (the repository, the
   workdir, `/root`, `/proc`) do not exist in the sandbox;
4. forks the program as PID 1 of the new PID namespace: when it exits or
   is killed, the kernel kills every process left in the namespace (a
   fork that escaped its process group with `setsid` included). Before
   `exec` it sets the rlimits (CPU, address space, file size, processes,
   open files, no core dumps), empties its capability bounding set, sets
   no_new_privs and drops all capabilities, so neither it nor anything it
   execs holds a capability even in its own namespaces.

It reports on STATUS_FD JSON lines: {"pid": n}, the program's PID (the
runner kills it, and with it the namespace: this launcher's `waitpid`
returns only once every process in it is gone), then {"returncode": n} or
{"signal": n}; or {"error": "..."} for a failed set-up.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {'x86_64': 155, 'aarch64': 41}
NOBODY = 65534
SANDBOX_ID = 1000  # the program's uid and gid in its user namespace (root case)
DEVICES = ('null', 'zero', 'random', 'urandom')
ROOT = '/tmp'  # where the new root is built (in the private mount namespace)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(result, what):
  if result != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'{what}: {os.strerror(err)}')


def _mount(source, target, fstype, flags, data=None):
  enc = [None if s is None else s.encode() for s in (source, target, fstype)]
  _check(
    _libc.mount(*enc, flags, None if data is None else data.encode()),
    f'mount {target}',
  )


def _prctl(option, arg):
  _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f'prctl {option}')


def _die_with_parent(parent):
  _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != parent:  # the parent died before the prctl
    os._exit(137)


def _write(path, text):
  with open(path, 'w') as f:
    f.write(text)


def _unshare(flags):
  _check(_libc.unshare(flags | CLONE_NEWIPC | CLONE_NEWUTS), 'unshare')


def _map_ids(proc, uid, gid, inside):
  """Maps `inside` in the new user namespace to `uid`/`gid` outside;
  `proc` is a descriptor of /proc (the new root has none)."""
  for name, text in (
    ('setgroups', 'deny'),
    ('uid_map', f'{inside} {uid} 1'),
    ('gid_map', f'{inside} {gid} 1'),
  ):
    fd = os.open(f'self/{name}', os.O_WRONLY, dir_fd=proc)
    try:
      os.write(fd, text.encode())
    finally:
      os.close(fd)


def _enter_namespaces(request):
  """The namespaces and the new root (module doc). As root: the
  namespaces, root and scratch first, then the drop to `nobody` and a user
  namespace of its own (its process count is this sandbox's alone, and
  `nobody` can reach no file root keeps to itself). Otherwise the user
  namespace first, which grants the mounts."""
  proc = os.open('/proc', os.O_PATH | os.O_DIRECTORY)
  namespaces = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
  if os.geteuid() == 0:
    _unshare(namespaces)
    _build_root(request, NOBODY)
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    _prctl(PR_SET_DUMPABLE, 1)  # else /proc/self/uid_map stays root's
    _check(_libc.unshare(CLONE_NEWUSER), 'unshare user')
    _map_ids(proc, NOBODY, NOBODY, SANDBOX_ID)
  else:
    uid, gid = os.geteuid(), os.getegid()
    _unshare(namespaces | CLONE_NEWUSER)
    _map_ids(proc, uid, gid, 0)
    _build_root(request, None)
  os.close(proc)


def _bind(source, target, *, directory=True):
  """Bind-mounts `source` read-only at `target` (created in the new root);
  the remount keeps the flags the kernel locks on a mount seen from a user
  namespace (nosuid, nodev, noexec)."""
  if directory:
    os.makedirs(target, exist_ok=True)
  else:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    open(target, 'w').close()
  _mount(source, target, None, MS_BIND | MS_REC)
  locked = os.statvfs(source).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
  _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def _build_root(request, owner):
  _mount(None, '/', None, MS_REC | MS_PRIVATE)
  _mount('tmpfs', ROOT, 'tmpfs', MS_NOSUID | MS_NODEV, 'size=1m,mode=0755')
  for name in sorted(os.listdir('/')):
    path = '/' + name
    if os.path.islink(path) and name.startswith(('bin', 'sbin', 'lib')):
      os.symlink(os.readlink(path), ROOT + path)
  for path in request['binds']:
    _bind(path, ROOT + path)
  for name in DEVICES:
    _bind('/dev/' + name, f'{ROOT}/dev/{name}', directory=False)
  if os.path.exists('/etc/ld.so.cache'):
    _bind('/etc/ld.so.cache', ROOT + '/etc/ld.so.cache', directory=False)
  scratch = ROOT + '/scratch'
  os.mkdir(scratch)
  size = f'size={request["limits"]["scratch_mb"]}m,mode=0755'
  _mount('tmpfs', scratch, 'tmpfs', MS_NOSUID | MS_NODEV, size)
  for name, text in request['files'].items():
    _write(os.path.join(scratch, name), text)
  if owner is not None:
    for name in ['.', *request['files']]:
      os.chown(os.path.join(scratch, name), owner, owner)
  os.mkdir(ROOT + '/proc')  # empty: no view of the host's processes
  _mount(None, ROOT, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
  os.chdir(ROOT)
  number = SYS_PIVOT_ROOT[platform.machine()]
  _check(_libc.syscall(number, b'.', b'.'), 'pivot_root')
  _check(_libc.umount2(b'.', MNT_DETACH), 'umount old root')
  os.chdir('/scratch')


def _set_limits(limits):
  mib = 1 << 20
  for which, value in (
    (resource.RLIMIT_CPU, limits['cpu_s']),
    (resource.RLIMIT_AS, limits['memory_mb'] * mib),
    (resource.RLIMIT_FSIZE, limits['file_mb'] * mib),
    (resource.RLIMIT_NPROC, limits['procs']),
    (resource.RLIMIT_NOFILE, limits['open_files']),
    (resource.RLIMIT_CORE, 0),
  ):
    resource.setrlimit(which, (value, value))


def _drop_capabilities():
  for cap in range(64):
    if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
      break  # past the last capability this kernel knows
  _prctl(PR_SET_NO_NEW_PRIVS, 1)
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
  data = (ctypes.c_uint32 * 6)()
  _check(_libc.capset(header, data), 'capset')


def _program(request):
  """The forked child: PID 1 of the new namespace; never returns. (Its
  parent is outside the namespace, so getppid() is 0 and cannot tell that
  the launcher died before the prctl: the runner's kill of the process
  group reaches it then.)"""
  try:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _set_limits(request['limits'])
    _drop_capabilities()
    python = request['python']
    env = {
      'PATH': '/usr/bin:/bin',
      'HOME': '/scratch',
      'TMPDIR': '/scratch',
      'LANG': 'C.UTF-8',
      'PYTHONDONTWRITEBYTECODE': '1',
      'PYTHONHASHSEED': '0',
    }
    os.execve(python, [python, '-E', '-s', '-S', *request['argv']], env)
  except BaseException as e:
    os.write(2, f'sandbox: {e}\n'.encode())
  os._exit(126)


def main():
  status = os.fdopen(int(sys.argv[1]), 'w')
  request = json.loads(sys.stdin.read())
  null = os.open('/dev/null', os.O_RDONLY)
  os.dup2(null, 0)
  try:
    _die_with_parent(int(request['parent']))
    _enter_namespaces(request)
    pid = os.fork()
  except BaseException as e:
    status.write(json.dumps({'error': f'{type(e).__name__}: {e}'}) + '\n')
    return
  if pid == 0:
    status.close()
    _program(request)
  status.write(json.dumps({'pid': pid}) + '\n')  # the runner kills this one
  status.flush()
  _, code = os.waitpid(pid, 0)
  if os.WIFSIGNALED(code):
    report = {'signal': os.WTERMSIG(code)}
  else:
    report = {'returncode': os.WEXITSTATUS(code)}
  status.write(json.dumps(report) + '\n')


if __name__ == '__main__':
  main()
