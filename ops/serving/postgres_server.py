"""The local PostgreSQL server of a PERPETUA_HOME that uses PostgreSQL (ops/common/postgres.py).

One cluster per home under PERPETUA_HOME/postgres/data, created by `initdb` on first start,
listening on 127.0.0.1 (and a Unix socket inside the data directory, never the system's
/var/run/postgresql), password required. PostgreSQL refuses to run as root, so when the caller
is root the cluster belongs to the `postgres` system user that Debian's package creates, and the
server runs as that user.

The lifecycle is ops/serving/supervisor.py's, as for the MLflow and vLLM servers: a pid file
(postgres/server.json), the server in its own session with its output in postgres/server.log,
reuse of a running server, `perpetua stop` ending it. Two things are PostgreSQL's own: health is
a login to the server, and stopping sends SIGINT first (PostgreSQL's "fast" shutdown: it ends the
sessions of connected clients and writes a checkpoint; SIGTERM would wait for every client, such
as a running `dagster dev`, to disconnect).

The server outlives the command that started it: it is the storage of the Dagster instance, so
the daemon of `dagster dev` and the webserver need it after `perpetua demo` has returned.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ops.common import postgres as pg
from ops.common.paths import Home, home
from ops.serving import supervisor

BIN_ENV = "PERPETUA_PG_BIN"  # a folder holding initdb and postgres, when they are elsewhere
SYSTEM_USER = "postgres"  # who owns and runs the cluster when the caller is root
SOCKET_PATH_MAX = 100  # a Unix socket path must fit in 108 bytes, ".s.PGSQL.NNNNN" included


class PostgresServerError(RuntimeError):
    """The server could not be set up, started or stopped; the message says why."""


@dataclass(frozen=True)
class PostgresServer:
    url: str  # postgresql://user@host:port, without the password
    pid: int
    host: str
    port: int
    data: str
    log: str
    reused: bool = False


def pid_file(h: Home) -> Path:
    return pg.root(h) / "server.json"


def log_file(h: Home) -> Path:
    return pg.root(h) / "server.log"


def binaries() -> Path:
    """The folder with PostgreSQL's server programs: env PERPETUA_PG_BIN, else the newest
    /usr/lib/postgresql/<major>/bin (Debian's layout), else wherever PATH has `initdb`."""
    if os.environ.get(BIN_ENV):
        candidates = [Path(os.environ[BIN_ENV])]  # an explicit folder is the only one tried
    else:
        majors = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
        candidates = list(reversed(majors))
        if found := shutil.which("initdb"):
            candidates.append(Path(found).parent)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    raise PostgresServerError(
        "PostgreSQL's server programs (initdb, postgres) were not found: install Debian's `postgresql` "
        f"package (`apt-get install postgresql`, or `make setup` as root) or set {BIN_ENV} to their folder"
    )


def run_as() -> str | None:
    """The system user the cluster runs as: `postgres` when the caller is root, else the caller (None)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise PostgresServerError(
            f"running as root, PostgreSQL needs the `{SYSTEM_USER}` system user (Debian's postgresql package "
            "creates it); install the package or run as an ordinary user"
        ) from None
    return SYSTEM_USER


def check_reachable(path: Path, user: str) -> None:
    """Raise unless `user` (with its own group only, as the server runs) may enter every folder
    down to `path`: a home under a private folder (/root, pytest's 0700 temp root) is not."""
    entry = pwd.getpwnam(user)
    for folder in [*reversed(path.parents), path]:
        try:
            st = folder.stat()
        except FileNotFoundError:
            return  # made below by us, for the user
        bit = stat.S_IXUSR if st.st_uid == entry.pw_uid else stat.S_IXGRP if st.st_gid == entry.pw_gid else stat.S_IXOTH
        if not st.st_mode & bit:
            raise PostgresServerError(
                f"PostgreSQL refuses to run as root, so it runs as the `{user}` user, which cannot enter {folder} "
                f"(mode {stat.S_IMODE(st.st_mode):o}); put PERPETUA_HOME under folders others may enter, or `chmod o+x {folder}`"
            )


def _give(path: Path, user: str | None, mode: int) -> None:
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    os.chmod(path, mode)


def init_cluster(h: Home) -> bool:
    """Create the cluster with `initdb` unless it exists; True if it was created. A failed
    initdb leaves no half-made data directory behind."""
    data = pg.data_dir(h)
    if (data / "PG_VERSION").exists():
        return False
    bindir, user, s = binaries(), run_as(), pg.settings(h)
    if user is not None:
        check_reachable(data, user)
    data.mkdir(parents=True, exist_ok=True)
    if any(data.iterdir()):
        raise PostgresServerError(f"{data} is not empty but holds no PostgreSQL cluster; move it away")
    _give(data, user, 0o700)
    with tempfile.TemporaryDirectory(dir=pg.root(h), prefix=".initdb-") as tmp:
        _give(Path(tmp), user, 0o700)  # initdb (maybe as `postgres`) reads the password from here
        pwfile = Path(tmp) / "pw"
        pwfile.write_text(pg.password(h) + "\n")
        _give(pwfile, user, 0o600)
        argv = [str(bindir / "initdb"), "-D", str(data), "-U", s.user, f"--pwfile={pwfile}",
                "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C"]  # fmt: skip
        kw = {"user": user, "group": user, "extra_groups": []} if user else {}
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, **kw)
    if done.returncode != 0:
        shutil.rmtree(data, ignore_errors=True)
        raise PostgresServerError(f"initdb failed: {_last_lines(done.stderr + done.stdout)}")
    return True


def accepts(h: Home, url: str, timeout_s: float) -> bool:
    """True if the server at `url` (any scheme; host and port are read) lets this home's user log in."""
    try:
        import psycopg2
    except ImportError:
        raise PostgresServerError("psycopg2 is not installed; run `make setup` (it installs psycopg2-binary)") from None
    where = urlsplit(url)
    try:
        conn = psycopg2.connect(host=where.hostname, port=where.port, user=pg.settings(h).user, password=pg.password(h),
                                dbname="postgres", connect_timeout=max(2, int(timeout_s)))
    except psycopg2.OperationalError:
        return False
    conn.close()
    return True


def service(h: Home) -> supervisor.Service[PostgresServer]:
    return supervisor.Service("PostgreSQL server", pid_file(h), log_file(h), (b"-D", str(pg.data_dir(h)).encode()),
                              PostgresServer, PostgresServerError, lambda url, t: accepts(h, url, t))


def status(h: Home | None = None) -> PostgresServer | None:
    """The server running for this home, or None (a stale pid file is removed)."""
    h = h or home()
    return supervisor.status(service(h)) if pg.uses_postgres(h) else None


def ensure_databases(h: Home) -> list[str]:
    """Create the databases the stores use (pg.DATABASES) where missing; returns those created."""
    import psycopg2
    from psycopg2 import errors, sql

    s = pg.settings(h)
    conn = psycopg2.connect(host=s.host, port=s.port, user=s.user, password=pg.password(h), dbname="postgres", connect_timeout=5)
    conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    created = []
    try:
        with conn.cursor() as cur:
            for name in pg.DATABASES:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    try:
                        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                        created.append(name)
                    except errors.DuplicateDatabase:
                        pass  # created by a concurrent start
    finally:
        conn.close()
    return created


def start_if_used(h: Home) -> PostgresServer | None:
    """The home's server started (or reused) when the home keeps its records in PostgreSQL; None
    for a SQLite home. What every opener of the instance or the MLflow store calls first."""
    return start(h) if pg.uses_postgres(h) else None


def start(h: Home | None = None, timeout_s: float = 60.0) -> PostgresServer:
    """Start (or reuse) the home's server, creating the cluster and the databases on first use;
    returns once it accepts logins."""
    h = h or home()
    s = pg.settings(h)
    data = pg.data_dir(h)

    def launch() -> supervisor.Launch:
        bindir, user = binaries(), run_as()
        init_cluster(h)
        socket_dir = str(data) if len(str(data)) < SOCKET_PATH_MAX else ""  # "" = TCP only
        argv = [str(bindir / "postgres"), "-D", str(data), "-p", str(s.port),
                "-c", f"listen_addresses={s.host}", "-c", f"unix_socket_directories={socket_dir}"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no stray PGDATA/PGPORT
        return supervisor.Launch(argv, data, env, user=user)

    def ready(pid: int, url: str, seconds: float) -> PostgresServer:
        ensure_databases(h)
        return PostgresServer(f"postgresql://{s.user}@{s.host}:{s.port}", pid, s.host, s.port, str(data), str(log_file(h)))

    server = supervisor.start(service(h), s.host, s.port, launch, ready, timeout_s, poll_s=0.2)
    if server.reused:
        ensure_databases(h)  # cheap, and repairs a database someone dropped
    return server


def stop(h: Home | None = None, grace_s: float = 30.0) -> bool:
    """Stop the home's server (fast shutdown; SIGKILL to its group only if that hangs past
    `grace_s`); True if one was running."""
    h = h or home()
    svc = service(h)
    pid = supervisor.recorded_pid(svc)
    running = pid is not None and supervisor.owns(svc, pid)
    if running:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            supervisor.reap(pid)
            if not supervisor.alive(pid):
                break
            time.sleep(0.1)
    supervisor.stop(svc, grace_s=5.0)  # what is left of the group, and the pid file
    return running


def _last_lines(text: str, n: int = 8) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) or "(no output)"
