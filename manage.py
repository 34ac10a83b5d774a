#!/usr/bin/env python
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_site.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A setting refused at start-up (scheduler_site/env.py): its message, not a traceback.
        sys.exit(f"Configuration error: {exc}")
