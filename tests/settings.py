"""The product's settings, with the changes Django advises for tests: a fast password hasher,
and its test client's host name allowed.

PBKDF2's 1 000 000 iterations cost 0.3-0.4 s per user a test makes, and most dashboard tests
make one or two. Processes the suite starts (the ASGI server of the browser tests, `manage.py`
commands) inherit DJANGO_SETTINGS_MODULE, so they read the hashes these make.
"""

from scheduler_site.settings import *  # noqa: F403

PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]

ALLOWED_HOSTS = [*ALLOWED_HOSTS, "testserver"]  # noqa: F405 - Django's test client's host
