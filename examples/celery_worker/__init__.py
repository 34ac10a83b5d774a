"""A Celery app whose tasks run cronlease jobs through the Celery bridge (see app.py)."""
