"""Settings, read from the environment (see README, "Configuration")."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from ipaddress import ip_network
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from scheduler_site import embedded_db, shardmap
from scheduler_site.database import config_from_url
from scheduler_site.env import (
    env_bool,
    env_choice,
    env_float,
    env_folder,
    env_int,
    env_list,
    env_rate,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent
# Local state: the embedded database, payload blobs, metrics files. Tests point it elsewhere.
DATA_DIR = env_folder("SCHEDULER_DATA_DIR", str(BASE_DIR / ".data"), create=True)
# prometheus_client reads this one itself, when apps/runs/metrics.py imports it, and raised there
# (a traceback) on a folder that does not exist or a file: checked first, it is a setting's error.
if env_str("PROMETHEUS_MULTIPROC_DIR"):
    env_folder("PROMETHEUS_MULTIPROC_DIR", "", create=False)

DEBUG = env_bool("DEBUG", False)
# Served over HTTPS (production): secure cookies, HSTS, redirects to https, and no default key.
HTTPS = env_bool("SCHEDULER_HTTPS", False)
SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    if HTTPS:
        # Fail closed: sessions and CSRF tokens signed with a published key are forgeable.
        raise ImproperlyConfigured("SECRET_KEY must be set when SCHEDULER_HTTPS is on.")
    SECRET_KEY = "django-insecure-development-key-set-SECRET_KEY-in-production"
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "apps.teams",
    "apps.audit",
    "apps.jobs",
    "apps.runs",
    "apps.scheduler",
    "apps.notify",
    "apps.api",
    "apps.demo",
    "apps.ops",
    # The dashboard: server-rendered pages with HTMX partials, live updates over Channels.
    "channels",
    "django_htmx",
    "template_partials",
    "apps.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files from the web process itself (no CDN, no separate server needed).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "apps.api.encoding.RefuseEncodedBodies",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "apps.dashboard.middleware.SignInRequiredMiddleware",
    "apps.dashboard.middleware.ContentSecurityPolicyMiddleware",
    "apps.dashboard.middleware.UnavailableShardsMiddleware",
]

ROOT_URLCONF = "scheduler_site.urls"
ASGI_APPLICATION = "scheduler_site.asgi.application"
WSGI_APPLICATION = "scheduler_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "apps.dashboard.context.unavailable_shards",
                "apps.dashboard.context.request_limits",
            ],
        },
    },
]


# The management command this process runs ("" for the web process).
_COMMAND = sys.argv[1] if len(sys.argv) > 1 and sys.argv[0].endswith("manage.py") else ""


def _application_name() -> str:
    """Name the connection after the process so pg_stat_activity shows who is who."""
    explicit = env_str("SCHEDULER_APPLICATION_NAME")
    if explicit:
        return explicit
    return f"scheduler:{_COMMAND}" if _COMMAND else "scheduler:web"


DATABASE_URL = env_str("DATABASE_URL")
EMBEDDED_DATABASE = not DATABASE_URL
if EMBEDDED_DATABASE:
    DATABASE_URL = embedded_db.ensure_running(DATA_DIR)
# asgi.py sets SCHEDULER_DB_POOL: the web process takes connections from a pool of this size.
# The pool's settings are read (and a bad one refused) in every process: read in the web's
# workers alone, a bad value stopped each worker as it started, and `manage.py web` restarted
# them without end instead of stopping with the configuration error.
_POOL_SIZE = env_int("SCHEDULER_DB_POOL_SIZE", 20, low=1, high=1000)
_POOL_LOCK_TIMEOUT = env_int("SCHEDULER_DB_LOCK_TIMEOUT", 10, low=0, high=86400)
_POOL_STATEMENT_TIMEOUT = env_int("SCHEDULER_DB_STATEMENT_TIMEOUT", 60, low=0, high=86400)
DB_POOL_SIZE = _POOL_SIZE if env_bool("SCHEDULER_DB_POOL", False) else None
# The web process's statements wait at most DB_LOCK_TIMEOUT seconds for a lock and run at most
# DB_STATEMENT_TIMEOUT: a request behind another session's lock (a psql transaction left open)
# held a pooled connection, and the process's stop, for as long as that session lived.
# A scheduler's statements wait for a lock at most a third of its shard lease: its leases are
# renewed by the loop that runs them, and one retention round waiting 10 s behind a session
# holding the audit table let them lapse (another node took the shards). A statement that gives
# up fails its tick; the next tick renews first. Their run time is not bounded: retention and
# materialisation batches may rightly take longer.
SCHEDULER_SHARD_LEASE_SECONDS = env_int("SCHEDULER_SHARD_LEASE_SECONDS", 10, low=1, high=3600)
if DB_POOL_SIZE:
    DB_LOCK_TIMEOUT: float = _POOL_LOCK_TIMEOUT
elif _COMMAND == "scheduler":
    DB_LOCK_TIMEOUT = SCHEDULER_SHARD_LEASE_SECONDS / 3
else:
    DB_LOCK_TIMEOUT = 0
DB_STATEMENT_TIMEOUT = _POOL_STATEMENT_TIMEOUT if DB_POOL_SIZE else 0
DB_CONNECTION = {
    "pool_size": DB_POOL_SIZE,
    "lock_timeout": DB_LOCK_TIMEOUT,
    "statement_timeout": DB_STATEMENT_TIMEOUT,
}
DATABASES = {
    "default": config_from_url(DATABASE_URL, application_name=_application_name(), **DB_CONNECTION)
}
# Shards on databases of their own (scheduler_site/shardmap.py; routed by apps/runs/shards.py).
SCHEDULER_SHARD_COUNT = env_int("SCHEDULER_SHARD_COUNT", 16)
if not 1 <= SCHEDULER_SHARD_COUNT <= 1024:  # a run id has room for 1 024 shards
    raise ImproperlyConfigured("SCHEDULER_SHARD_COUNT must be from 1 to 1024.")
try:
    SHARD_MAP = shardmap.parse(
        env_str("SCHEDULER_SHARD_DATABASES"), SCHEDULER_SHARD_COUNT, DATABASE_URL
    )
except shardmap.ShardMapError as exc:
    raise ImproperlyConfigured(f"SCHEDULER_SHARD_DATABASES: {exc}") from exc
for _alias, _url in SHARD_MAP.urls.items():
    DATABASES[_alias] = config_from_url(_url, application_name=_application_name(), **DB_CONNECTION)
DATABASE_ROUTERS = ["apps.runs.shards.ShardRouter"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Every place that sets a password checks it against these (createteam, Django's own commands and
# admin); a refusal names the rule it broke.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Django's own check of user name and password, behind the sign-in lockout (apps/teams/lockout.py).
AUTHENTICATION_BACKENDS = ["apps.teams.lockout.SignInLockoutBackend"]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
MEDIA_ROOT = Path(env_str("MEDIA_ROOT", str(DATA_DIR / "media")))

# Payloads over 4 KB live in object storage: the file system by default, or an S3-compatible
# bucket through django-storages when SCHEDULER_PAYLOAD_BUCKET is set (credentials and endpoint
# from the usual AWS_* variables).
_PAYLOAD_BUCKET = env_str("SCHEDULER_PAYLOAD_BUCKET")
if _PAYLOAD_BUCKET and importlib.util.find_spec("storages") is None:
    # Checked now, not at the first large payload (a 500 then, on every one).
    raise ImproperlyConfigured(
        'SCHEDULER_PAYLOAD_BUCKET needs django-storages: pip install -e ".[s3]".'
    )
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "payloads": (
        {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {"bucket_name": _PAYLOAD_BUCKET}}
        if _PAYLOAD_BUCKET
        else {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(MEDIA_ROOT)},
        }
    ),
}

LOGIN_URL = "/accounts/login/"

# A session lasts 12 hours from sign-in, then the engineer signs in again.
SESSION_COOKIE_AGE = env_int("SESSION_COOKIE_AGE", 12 * 3600, low=60, high=366 * 86400)
SESSION_SAVE_EVERY_REQUEST = False
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
SECURE_SSL_REDIRECT = HTTPS
SECURE_HSTS_SECONDS = 31536000 if HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = HTTPS
SECURE_HSTS_PRELOAD = HTTPS
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto and appends the client's address to
# X-Forwarded-For; only then is that header believed (apps/teams/lockout.py, client_address).
SCHEDULER_BEHIND_PROXY = env_bool("SCHEDULER_BEHIND_PROXY", False)
if SCHEDULER_BEHIND_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# --- dashboard -------------------------------------------------------------------------------
# whitenoise serves static files from the finders too, so the dashboard works under uvicorn
# without a collectstatic step; `manage.py collectstatic` still fills STATIC_ROOT for production.
WHITENOISE_USE_FINDERS = True
# …so STATIC_ROOT may be empty, but whitenoise warns unless it exists.
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# whitenoise streams files through a sync iterator; under ASGI Django says so once per file.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous")
# Live updates: Redis carries channel-layer messages between web processes when REDIS_URL is
# set; one process (development, tests) needs nothing but memory.
REDIS_URL = env_str("REDIS_URL")
CHANNEL_LAYERS = {
    "default": (
        {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # A socket's consumer waits for its next message with a blocking pop of 5 s
            # (RedisChannelLayer.brpop_timeout); redis-py 8 gives up on any read after 5 s by
            # default, so an idle page's wait ended in a TimeoutError, a traceback and a
            # reconnect every 5-10 s. Reads here may wait longer than the pop.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}]},
        }
        if REDIS_URL
        else {"BACKEND": "channels.layers.InMemoryChannelLayer"}
    )
}
# The per-token rate limits count in the cache (apps/api/throttling.py): in Redis, when set, so
# a token's limit holds across every web process; else in each process's memory.
CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "cronlease",
        }
        if REDIS_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}
# How often each web process with open dashboard sockets looks for changed runs (seconds).
DASHBOARD_LIVE_INTERVAL = env_float("DASHBOARD_LIVE_INTERVAL", 1.0, low=0.05, high=3600)
# Every dashboard page: scripts and styles from this origin only, never inline.
DASHBOARD_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'self'; "
    "form-action 'self'; frame-ancestors 'none'"
)

# The API answers every request under `/api/` in JSON with problem details on errors.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["apps.api.auth.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["apps.api.permissions.HasScope"],
    "DEFAULT_RENDERER_CLASSES": ["apps.api.renderers.FastJSONRenderer"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "apps.api.renderers.Negotiation",
    "DEFAULT_PARSER_CLASSES": ["apps.api.parsers.JSONObjectParser"],
    "EXCEPTION_HANDLER": "apps.api.errors.problem_exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["apps.api.throttling.TokenRateThrottle"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "cronlease API",
    "DESCRIPTION": "Job definitions, runs, the dead-letter queue and the worker lease protocol.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI and ReDoc from the drf-spectacular-sidecar package's static files, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "apps.api.schema.declare_refusals",
    ],
}

# Request bodies up to the payload cap plus room for the envelope; anything larger is a 413.
SCHEDULER_PAYLOAD_MAX_BYTES = env_int(
    "SCHEDULER_PAYLOAD_MAX_BYTES", 1024 * 1024, low=1, high=256 * 1024 * 1024
)
DATA_UPLOAD_MAX_MEMORY_SIZE = SCHEDULER_PAYLOAD_MAX_BYTES + 64 * 1024
# A request's line and headers together (scheduler_site/http_protocol.py): past it, the HTTP
# server answers a plain-text 400. Browsers' and proxies' heads are a few kilobytes.
SCHEDULER_MAX_HEADER_BYTES = env_int(
    "SCHEDULER_MAX_HEADER_BYTES", 64 * 1024, low=8 * 1024, high=16 * 1024 * 1024
)
# Objects and lists nested deeper than this in any JSON body, payload, result or file are a 400
# (apps/runs/limits.py): what is accepted must be storable and renderable.
SCHEDULER_JSON_MAX_DEPTH = env_int("SCHEDULER_JSON_MAX_DEPTH", 64, low=2, high=1000)
# A run may not be asked for further in the past than this (backfill is the tool for the past).
SCHEDULER_RUN_AT_PAST_SECONDS = env_int(
    "SCHEDULER_RUN_AT_PAST_SECONDS", 86400, low=0, high=3660 * 86400
)

# Requests per token and scope ("N/s", "N/min", "N/hour"); an empty value turns a limit off.
SCHEDULER_API_RATES = {
    "worker": env_rate("SCHEDULER_API_RATE_WORKER", "3000/s"),
    "manage": env_rate("SCHEDULER_API_RATE_MANAGE", "20/s"),
    # Counted per run created, not per request (apps/api/throttling.py, charge_enqueue).
    "enqueue": env_rate("SCHEDULER_API_RATE_ENQUEUE", "5000/s"),
}
# Most runs one POST /api/v1/runs may create.
SCHEDULER_MAX_ENQUEUE = env_int("SCHEDULER_MAX_ENQUEUE", 1000, low=1, high=100_000)

# Failed sign-ins (apps/teams/lockout.py): a user name, or a client address, with this many
# failures within the window is refused, even the right password, until the oldest of them leaves
# the window. Counted in the database, so the limits hold across web processes. 0 turns one off.
SCHEDULER_LOGIN_FAILURES_PER_USER = env_int(
    "SCHEDULER_LOGIN_FAILURES_PER_USER", 5, low=0, high=1_000_000
)
SCHEDULER_LOGIN_FAILURES_PER_ADDRESS = env_int(
    "SCHEDULER_LOGIN_FAILURES_PER_ADDRESS", 20, low=0, high=1_000_000
)
SCHEDULER_LOGIN_LOCKOUT_SECONDS = env_int(
    "SCHEDULER_LOGIN_LOCKOUT_SECONDS", 900, low=1, high=366 * 86400
)
# Unknown or revoked bearer tokens (apps/api/auth.py): a client address with this many within the
# window gets 429 for the rest of it, without a database lookup. Counted per web process.
SCHEDULER_TOKEN_FAILURES_PER_ADDRESS = env_int(
    "SCHEDULER_TOKEN_FAILURES_PER_ADDRESS", 30, low=0, high=1_000_000
)
SCHEDULER_TOKEN_FAILURE_WINDOW_SECONDS = env_int(
    "SCHEDULER_TOKEN_FAILURE_WINDOW_SECONDS", 60, low=1, high=86400
)

SCHEDULER_LOOKAHEAD_SECONDS = env_int("SCHEDULER_LOOKAHEAD_SECONDS", 60, low=0, high=86400)
SCHEDULER_TICK_SECONDS = env_float("SCHEDULER_TICK_SECONDS", 1.0, low=0.01, high=3600)
SCHEDULER_MISSED_RUNS_CAP = env_int("SCHEDULER_MISSED_RUNS_CAP", 1000, low=0, high=1_000_000)
SCHEDULER_BACKFILL_CAP = env_int("SCHEDULER_BACKFILL_CAP", 10000, low=1, high=1_000_000)
SCHEDULER_RETENTION_DAYS = env_int("SCHEDULER_RETENTION_DAYS", 30, low=1, high=36_600)
SCHEDULER_AUDIT_RETENTION_DAYS = env_int("SCHEDULER_AUDIT_RETENTION_DAYS", 365, low=1, high=36_600)
SCHEDULER_RETENTION_BATCH = env_int("SCHEDULER_RETENTION_BATCH", 1000, low=1, high=100_000)
SCHEDULER_RETENTION_INTERVAL_SECONDS = env_int(
    "SCHEDULER_RETENTION_INTERVAL_SECONDS", 60, low=1, high=86400
)
# The census of each shard database's runs (apps/runs/census.py): how often the scheduler takes
# it, and how many runs of theirs the overview and queues pages count on each load before they
# read it instead.
SCHEDULER_CENSUS_SECONDS = env_int("SCHEDULER_CENSUS_SECONDS", 15, low=1, high=86400)
SCHEDULER_LIVE_COUNT_LIMIT = env_int(
    "SCHEDULER_LIVE_COUNT_LIMIT", 100_000, low=0, high=1_000_000_000
)
# A lease call's `leaseSeconds` when it gives none.
SCHEDULER_DEFAULT_LEASE_SECONDS = env_int("SCHEDULER_DEFAULT_LEASE_SECONDS", 60, low=1, high=86400)
SCHEDULER_MAX_WAIT_SECONDS = env_int("SCHEDULER_MAX_WAIT_SECONDS", 30, low=0, high=3600)
SCHEDULER_MAX_CLAIM = env_int("SCHEDULER_MAX_CLAIM", 1000, low=1, high=100_000)
SCHEDULER_REAPER_BATCH = env_int("SCHEDULER_REAPER_BATCH", 500, low=1, high=100_000)
# /metrics and /readyz answer clients in these networks only (/healthz answers everyone, for load
# balancers): loopback and the private ranges unless set; "0.0.0.0/0,::/0" opens them to all.
# The client is the one apps/teams/lockout.py's client_address names (SCHEDULER_BEHIND_PROXY).
SCHEDULER_OPS_ALLOWED_NETWORKS = env_list(
    "SCHEDULER_OPS_ALLOWED_NETWORKS",
    ["127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"],
)
for _network in SCHEDULER_OPS_ALLOWED_NETWORKS:
    try:
        ip_network(_network, strict=False)
    except ValueError as exc:  # at start, not on the first scrape
        raise ImproperlyConfigured(f"SCHEDULER_OPS_ALLOWED_NETWORKS: {exc}") from exc
# When set, /metrics and /readyz also need `Authorization: Bearer <this token>`.
SCHEDULER_OPS_TOKEN = env_str("SCHEDULER_OPS_TOKEN")

# --- notifications (apps/notify; README, "Notifications") ---------------------------------------
# Webhook and Slack targets on loopback, private, link-local, reserved or multicast addresses are
# refused (SSRF), when a channel is saved and again at each delivery, unless this is true.
SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS = env_bool("SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS", False)
# How often the scheduler looks for dead runs, late and missed runs, a full DLQ, shards without
# an owner, and recoveries (seconds).
SCHEDULER_NOTIFY_INTERVAL_SECONDS = env_float(
    "SCHEDULER_NOTIFY_INTERVAL_SECONDS", 10.0, low=0.1, high=3600
)
# An open incident is paged again this often (0: never).
SCHEDULER_NOTIFY_REMINDER_SECONDS = env_int(
    "SCHEDULER_NOTIFY_REMINDER_SECONDS", 3600, low=0, high=366 * 86400
)
# An incident closes (with a recovery message) once it has seen nothing new for this long and
# its job's latest run succeeded (or its condition is over): a flapping job stays one incident.
SCHEDULER_NOTIFY_RECOVERY_SECONDS = env_int(
    "SCHEDULER_NOTIFY_RECOVERY_SECONDS", 300, low=0, high=366 * 86400
)
# A team's dead-letter queue at or over this many runs opens a `dlq.threshold` incident.
SCHEDULER_NOTIFY_DLQ_THRESHOLD = env_int(
    "SCHEDULER_NOTIFY_DLQ_THRESHOLD", 100, low=1, high=1_000_000_000
)
# A shard whose lease has been expired (or never taken) this long is `scheduler.shard_unowned`.
SCHEDULER_NOTIFY_SHARD_UNOWNED_SECONDS = env_int(
    "SCHEDULER_NOTIFY_SHARD_UNOWNED_SECONDS", 30, low=1, high=86400
)
# How far back the first look of a new installation goes for dead, late and missed runs.
SCHEDULER_NOTIFY_LOOKBACK_SECONDS = env_int(
    "SCHEDULER_NOTIFY_LOOKBACK_SECONDS", 900, low=0, high=366 * 86400
)
# Deliveries: attempts before giving up, the backoff before attempt n (base · 2^(n-2), capped),
# and the timeout of one HTTP or SMTP conversation.
SCHEDULER_NOTIFY_MAX_ATTEMPTS = env_int("SCHEDULER_NOTIFY_MAX_ATTEMPTS", 8, low=1, high=1000)
SCHEDULER_NOTIFY_BACKOFF_SECONDS = env_int(
    "SCHEDULER_NOTIFY_BACKOFF_SECONDS", 15, low=0, high=86400
)
SCHEDULER_NOTIFY_BACKOFF_MAX_SECONDS = env_int(
    "SCHEDULER_NOTIFY_BACKOFF_MAX_SECONDS", 3600, low=0, high=366 * 86400
)
SCHEDULER_NOTIFY_TIMEOUT_SECONDS = env_float(
    "SCHEDULER_NOTIFY_TIMEOUT_SECONDS", 10.0, low=0.1, high=3600
)
# Threads of each scheduler process that send deliveries, one at a time each (a database
# connection each).
SCHEDULER_NOTIFY_SENDERS = env_int("SCHEDULER_NOTIFY_SENDERS", 4, low=1, high=64)
# Most channels per team.
SCHEDULER_NOTIFY_MAX_CHANNELS = env_int("SCHEDULER_NOTIFY_MAX_CHANNELS", 50, low=1, high=10_000)
# The dashboard's address as people reach it: the links in notifications start with it.
SCHEDULER_PUBLIC_URL = env_str("SCHEDULER_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
# Email channels: Django's mail backends, SMTP unless EMAIL_BACKEND says otherwise
# (`django.core.mail.backends.console.EmailBackend` prints them; `make run` uses it).
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, low=1, high=65535)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = SCHEDULER_NOTIFY_TIMEOUT_SECONDS
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "cronlease@localhost")

# JSON lines by default (one run can be followed across processes by its run_id); LOG_FORMAT=plain
# for a terminal.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "apps.ops.logs.JsonFormatter"},
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": env_choice("LOG_FORMAT", "json", ("json", "plain")),
        }
    },
    "root": {
        "handlers": ["console"],
        "level": env_choice("LOG_LEVEL", "INFO", LOG_LEVELS),
    },
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "scheduler.runs": {"level": env_choice("LOG_RUNS_LEVEL", "INFO", LOG_LEVELS)},
    },
}
