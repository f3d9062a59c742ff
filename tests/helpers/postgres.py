"""A throwaway PostgreSQL server for the tests of shared studies: ``postgres_url`` is the URL of
a fresh database on it (``postgresql://postgres@/NAME?host=SOCKET_DIR``).

One server per test process (an xdist worker), started on first use: ``initdb`` into a
temporary folder, ``pg_ctl start`` listening only on a Unix socket in that folder (no TCP port
to collide with another worker's), ``fsync`` off; each test gets a database of its own
(``createdb``). PostgreSQL refuses to run as root: as root the server runs as the ``postgres``
user (else ``nobody``) through ``runuser``, and connections come in over the socket with
``trust`` authentication. Missing PostgreSQL binaries fail the test with what to install; they
are not a reason to skip (CI installs Debian's ``postgresql``).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "postgres_server", "postgres_url", "pg_bin"]

_INSTALL = "apt-get install postgresql (Debian), or put PostgreSQL's bin folder on PATH"


def pg_bin() -> Path:
    """The folder of PostgreSQL's server programs (initdb, pg_ctl, createdb)."""
    found = shutil.which("pg_ctl")
    if found:
        folder = Path(os.path.realpath(found)).parent
        if (folder / "initdb").exists():
            return folder
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):  # Debian's layout, newest first
        if os.path.exists(os.path.join(folder, "pg_ctl")):
            return Path(folder)
    pytest.fail(f"PostgreSQL's server programs (initdb, pg_ctl) are not installed: {_INSTALL}", pytrace=False)


def _server_user() -> str | None:
    """The user the server runs as: None (this one) unless this one is root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    pytest.fail("running as root, and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL as",
                pytrace=False)


class PostgresServer:
    """A PostgreSQL cluster in a temporary folder, reached through its Unix socket."""

    def __init__(self) -> None:
        self.bin = pg_bin()
        self.user = _server_user()
        self.root = Path(tempfile.mkdtemp(prefix="memplan-pg-"))
        self.port = 5432  # only names the socket file: the server listens on no TCP port
        self._names = itertools.count()
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.root / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--no-sync", "--no-instructions")
        options = f"-k {self.root} -p {self.port} -c listen_addresses='' -c fsync=off -c max_connections=100"
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", options, "-l", str(self.root / "server.log"),
                  "-w", "-t", "30", "start")

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin / program), *args]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            pytest.fail(f"{program} failed ({done.returncode}): {done.stderr.strip()}\n{tail}", pytrace=False)

    def create_database(self, prefix: str = "memplan") -> str:
        """A fresh database; returns its SQLAlchemy URL."""
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        self._run("createdb", "-h", str(self.root), "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@/{database}?host={self.root}&port={self.port}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """This test process's PostgreSQL server (started on first use, stopped at the end)."""
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a fresh database of its own for this test."""
    return postgres_server.create_database()
