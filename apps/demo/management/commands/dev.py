"""Run the whole system for development: database, web, scheduler and a demo worker.

Ctrl-C (SIGINT) or SIGTERM stops every process it started, then exits. The embedded databases
outlive it, as they do the other commands (`make stop-db` stops them).

`--shard-databases N` starts N more embedded PostgreSQL servers (`<data dir>/pg-shard-1` … `-N`)
and puts the shards on them in N ranges, none on the control database: the sharded layout
on one machine.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TextIO

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from apps.demo.data import PASSWORD, QUEUE, THROTTLED_QUEUE, USERNAME, load_demo
from apps.runs import shards
from scheduler_site import embedded_db, shardmap

COLOURS = {"web": "\033[36m", "scheduler": "\033[35m", "worker": "\033[32m"}
RESET = "\033[0m"


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-worker", action="store_true", help="do not start the demo worker")
        parser.add_argument(
            "--shard-databases",
            type=int,
            default=0,
            metavar="N",
            help="start N more embedded PostgreSQL servers and put the shards on them "
            "(default 0: every shard on the control database)",
        )

    def handle(
        self, *args, host: str, port: int, no_worker: bool, shard_databases: int, **options
    ) -> None:
        if not 0 <= port <= 65535:  # before the migration and the demo data, not after
            raise CommandError("--port must be a whole number from 0 to 65535.")
        if shard_databases:
            self._restart_on_shard_servers(shard_databases, host, port, no_worker)
        self.shutdown = threading.Event()
        self.lock = self._hold_data_dir()
        call_command("migrate", interactive=False, verbosity=0)
        demo = load_demo()
        url = f"http://{host}:{port}"
        database = (
            f"embedded PostgreSQL in {settings.DATA_DIR}/pg"
            if settings.EMBEDDED_DATABASE
            else "DATABASE_URL"
        )
        if shards.physical():
            database += shard_lines()
        self.stdout.write(
            f"\nDatabase:  {database}\nAPI:       {url}/api/v1/  (docs: {url}/api/docs/)\n"
            f"Sign in:   {url}/accounts/login/  as {USERNAME} / {PASSWORD}\n"
            f"Token:     {demo.token}\n\nCtrl-C stops everything.\n\n"
        )
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "LOG_FORMAT": os.environ.get("LOG_FORMAT", "plain"),
            # The demo channel's emails are printed by the scheduler, not sent.
            "EMAIL_BACKEND": os.environ.get(
                "EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend"
            ),
        }
        # Web and scheduler count into one folder, so /metrics adds up both processes. Emptied
        # of the files of processes gone (their counts would be added in): under the data
        # folder's lock, none of them still runs.
        metrics_dir = Path(settings.DATA_DIR) / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        if settings.EMBEDDED_DATABASE:
            env["DATABASE_URL"] = settings.DATABASE_URL
        root = Path(settings.BASE_DIR)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root), str(root / "client"), env.get("PYTHONPATH", "")]
        )
        commands = {
            "web": [sys.executable, "manage.py", "web", "--host", host, "--port", str(port)],
            "scheduler": [sys.executable, "manage.py", "scheduler"],
        }
        if not no_worker:
            commands["worker"] = [
                sys.executable,
                "-m",
                "cronlease_client",
                "run",
                "apps.demo.handlers",
                "--queue",
                QUEUE,
                "--queue",
                THROTTLED_QUEUE,
                "--url",
                url,
                "--token",
                demo.token,
                "--concurrency",
                "4",
            ]
        processes = {
            name: self._spawn(name, command, env, root) for name, command in commands.items()
        }
        signal.signal(signal.SIGINT, lambda *_: self.shutdown.set())
        signal.signal(signal.SIGTERM, lambda *_: self.shutdown.set())
        failed = None
        while not self.shutdown.is_set():
            for name, process in processes.items():
                # A Ctrl-C reaches the parts too: one that stops for it is no failure.
                if process.poll() is not None and not self.shutdown.is_set():
                    failed = f"{name} exited with {process.returncode}; stopping the rest."
                    self.stderr.write(failed)
                    self.shutdown.set()
            self.shutdown.wait(0.5)
        self._stop(processes)
        if failed is not None:  # not a Ctrl-C: the command failed (exit 1), as its part did
            raise CommandError(failed)

    def _restart_on_shard_servers(self, count: int, host: str, port: int, no_worker: bool) -> None:
        """Start `count` embedded servers, then run this command again in this process with the
        shard map that puts the shards on them.

        Settings (and so every database alias) were loaded before the map was known; replacing
        the process (`exec`) loads them again with it, and keeps the pid that a terminal's
        Ctrl-C or a supervisor's SIGTERM is sent to."""
        if not 1 <= count <= settings.SCHEDULER_SHARD_COUNT:
            raise CommandError(
                f"--shard-databases must be from 1 to {settings.SCHEDULER_SHARD_COUNT}."
            )
        if os.environ.get("SCHEDULER_SHARD_DATABASES"):
            raise CommandError(
                "SCHEDULER_SHARD_DATABASES is set already: leave out --shard-databases, or unset it."
            )
        data_dir = Path(settings.DATA_DIR)
        urls = []
        for number in range(1, count + 1):
            self.stdout.write(
                f"Starting embedded PostgreSQL in {data_dir}/{embedded_db.shard_server(number)} …"
            )
            urls.append(embedded_db.ensure_running(data_dir, embedded_db.shard_server(number)))
        env = {
            **os.environ,
            "SCHEDULER_SHARD_DATABASES": shardmap.spread(settings.SCHEDULER_SHARD_COUNT, urls),
        }
        command = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "dev"]
        command += ["--host", host, "--port", str(port)] + ["--no-worker"] * no_worker
        self.stdout.flush()
        sys.stdout.flush()
        os.execve(sys.executable, command, env)

    def _hold_data_dir(self) -> TextIO:
        """Lock the data folder for this command and the processes it starts, or refuse to run.

        A second `dev` on the folder of a running one revoked the running demo worker's token
        (`load_demo`) and emptied the metrics folder the running processes count in: their
        counts were lost for good, even when the second then stopped, finding the port taken.
        The lock is the open file's, and every child holds it too (`_spawn`), so it lasts while
        any of them runs, this command killed with -9 included."""
        lock = open(Path(settings.DATA_DIR) / "dev.lock", "a")  # open until this process exits
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise CommandError(
                f"Another `manage.py dev` (or a process it started) runs on {settings.DATA_DIR}: "
                "stop it first, or give this one a SCHEDULER_DATA_DIR of its own."
            ) from None
        return lock

    def _spawn(self, name: str, command: list[str], env: dict, cwd: Path) -> subprocess.Popen:
        # Each child gets its own process group, so a terminal's Ctrl-C reaches only this
        # command, which then stops the children in order.
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
            pass_fds=(self.lock.fileno(),),
        )
        threading.Thread(target=self._relay, args=(name, process), daemon=True).start()
        return process

    def _relay(self, name: str, process: subprocess.Popen) -> None:
        colour = COLOURS.get(name, "") if sys.stdout.isatty() else ""
        prefix = f"{colour}{name:<9}|{RESET if colour else ''} "
        for line in process.stdout:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()

    def _stop(self, processes: dict[str, subprocess.Popen]) -> None:
        # The worker first (it finishes in-flight runs), then the scheduler, then the web.
        for name in ("worker", "scheduler", "web"):
            process = processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=35)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.stdout.write("All processes stopped.")


def shard_lines() -> str:
    """The banner's lines on where the shards are, with the map other commands need to see the
    same layout (`manage.py shell`, a second scheduler)."""
    url_of = {shards.CONTROL: "the control database", **settings.SHARD_MAP.urls}
    lines = [f"Shards {shards.span(alias)}: {url_of[alias]}" for alias in shards.databases()]
    lines.append(f"SCHEDULER_SHARD_DATABASES='{os.environ['SCHEDULER_SHARD_DATABASES']}'")
    return " (the control database)" + "".join(f"\n           {line}" for line in lines)
