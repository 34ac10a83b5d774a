"""Create a team (and its admin user) and print a new API token alone on the last line."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils.text import slugify

from apps.audit.record import Actor, record
from apps.teams.models import ApiToken, Membership, Role, Scope, Team


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", default="")
        parser.add_argument(
            "--admin", metavar="USERNAME", help="create (or reuse) this user as the team's admin"
        )
        parser.add_argument(
            "--password", metavar="PW", help="the admin's password (new users only)"
        )
        parser.add_argument(
            "--scopes", default="worker,manage", help="comma-separated: worker, manage"
        )

    def handle(
        self,
        *args,
        slug: str,
        name: str,
        admin: str | None,
        password: str | None,
        scopes: str,
        **options,
    ) -> None:
        if slugify(slug) != slug:
            raise CommandError(f"'{slug}' is not a slug: use lowercase letters, digits and '-'.")
        # Checked before anything is written: a refusal leaves no team behind, and no value
        # reaches a column too narrow for it (a traceback, and "Created team" printed first).
        user_model = get_user_model()
        for what, value, field in (
            ("The slug", slug, Team._meta.get_field("slug")),
            ("--name", name, Team._meta.get_field("name")),
            ("--admin", admin or "", user_model._meta.get_field(user_model.USERNAME_FIELD)),
        ):
            if len(value) > field.max_length:
                raise CommandError(f"{what} is longer than {field.max_length} characters.")
        if admin and not user_model.objects.filter(username=admin).exists():
            try:
                user_model.username_validator(admin)
            except ValidationError as exc:
                raise CommandError(f"--admin: {' '.join(exc.messages)}") from exc
        if password is not None and not admin:
            raise CommandError("--password is the admin's: give --admin USERNAME with it.")
        wanted = [scope.strip() for scope in scopes.split(",") if scope.strip()]
        unknown = set(wanted) - set(Scope.values)
        if unknown or not wanted:
            raise CommandError(f"Unknown scopes {sorted(unknown)}; use worker and/or manage.")
        if (
            admin
            and password is not None
            and not user_model.objects.filter(username=admin).exists()
        ):
            try:
                validate_password(password, user_model(username=admin))
            except ValidationError as exc:
                raise CommandError("The password is refused: " + " ".join(exc.messages)) from exc
        actor = Actor.cli("createteam")
        with transaction.atomic():
            team, created = Team.objects.get_or_create(slug=slug, defaults={"name": name or slug})
            if created:
                record(
                    actor,
                    "team.create",
                    team=team,
                    target_type="team",
                    target=slug,
                    after={"name": team.name},
                )
                self.stderr.write(f"Created team {slug}.")
            else:
                self.stderr.write(f"Team {slug} exists: issuing it another token.")
            if admin:
                user = user_model.objects.filter(username=admin).first()
                if user is None:
                    user = user_model.objects.create_user(admin, password=password)
                    self.stderr.write(f"Created user {admin}.")
                elif password is not None:
                    self.stderr.write(
                        f"User {admin} exists: its password is left as it was (--password is"
                        " for new users; `manage.py changepassword` changes one)."
                    )
                Membership.objects.update_or_create(
                    user=user, team=team, defaults={"role": Role.ADMIN}
                )
                record(
                    actor,
                    "member.set",
                    team=team,
                    target_type="member",
                    target=admin,
                    after={"role": "admin"},
                )
            token, raw = ApiToken.issue(team, wanted, name="createteam")
            record(
                actor,
                "token.create",
                team=team,
                target_type="token",
                target=token.prefix,
                after={"scopes": token.scopes},
            )
        self.stdout.write(raw)
