"""Run the whole system for development: database, web, scheduler and a demo worker.

Ctrl-C (SIGINT) or SIGTERM stops every process it started, then exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from apps.demo.data import PASSWORD, QUEUE, USERNAME, load_demo

COLOURS = {"web": "\033[36m", "scheduler": "\033[35m", "worker": "\033[32m"}
RESET = "\033[0m"


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-worker", action="store_true", help="do not start the demo worker")

    def handle(self, *args, host: str, port: int, no_worker: bool, **options) -> None:
        self.shutdown = threading.Event()
        call_command("migrate", interactive=False, verbosity=0)
        demo = load_demo()
        url = f"http://{host}:{port}"
        database = (
            f"embedded PostgreSQL in {settings.DATA_DIR}/pg"
            if settings.EMBEDDED_DATABASE
            else "DATABASE_URL"
        )
        self.stdout.write(
            f"\nDatabase:  {database}\nAPI:       {url}/api/v1/  (docs: {url}/api/docs/)\n"
            f"Sign in:   {url}/accounts/login/  as {USERNAME} / {PASSWORD}\n"
            f"Token:     {demo.token}\n\nCtrl-C stops everything.\n\n"
        )
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "LOG_FORMAT": os.environ.get("LOG_FORMAT", "plain"),
        }
        # Web and scheduler count into one folder, so /metrics adds up both processes.
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
        while not self.shutdown.is_set():
            for name, process in processes.items():
                if process.poll() is not None:
                    self.stderr.write(
                        f"{name} exited with {process.returncode}; stopping the rest."
                    )
                    self.shutdown.set()
            self.shutdown.wait(0.5)
        self._stop(processes)

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
