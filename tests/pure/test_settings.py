"""install(), the settings read from app.conf (misspelt, namespaced, pointless, a password
never shown) and declaration errors: what fails at import or at the worker's start, and
what is said. Pure: no Redis (the controller used directly is tests/script/test_direct.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery import Celery, shared_task

import celery_throttle
from celery_throttle import ConfigurationError, throttle
from celery_throttle.integration.worker import ThrottleStep
from tests.helpers import STORE_URL


def test_install_is_idempotent_and_reads_app_conf() -> None:
    app = Celery("idem", broker="redis://127.0.0.1:6379/3", set_as_current=False)
    app.conf.throttle_key_prefix = "custom"
    first = celery_throttle.install(app)
    second = celery_throttle.install(app)
    assert first is second
    assert list(app.steps["worker"]).count(ThrottleStep) == 1
    assert first.settings.key_prefix == "custom"
    assert first.settings.redis_url == "redis://127.0.0.1:6379/3"  # the broker, when Redis
    assert first.settings.default_algorithm == "sliding"
    assert celery_throttle.install(app, key_prefix="other").settings.key_prefix == "other"


def test_another_broker_without_throttle_redis_url_stops_the_worker_naming_the_setting() -> None:
    # Given an AMQP broker and no throttle_redis_url (no Redis to guess)
    app = Celery("amqp", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    ctl = celery_throttle.install(app)

    @app.task(name="amqp.charge")
    @celery_throttle.throttle("10/s")
    def charge(customer_id):
        return customer_id

    # Then the worker refuses to start, and a direct call says the same, never a localhost
    with pytest.raises(ConfigurationError, match=r"the broker is amqp://, not a Redis: set throttle_redis_url"):
        ThrottleStep(SimpleNamespace(app=app))
    with pytest.raises(ConfigurationError, match="throttle_redis_url"):
        ctl.acquire("x", rates=["1/s"])
    # And given the setting, it is used
    assert celery_throttle.install(app, redis_url="redis://127.0.0.1:6379/12").store.url.endswith("/12")


def test_bad_settings_fail_at_install() -> None:
    app = Celery("bad", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="throttle_default_algorithm"):
        celery_throttle.install(app, default_algorithm="leaky")
    with pytest.raises(ConfigurationError, match="unknown throttle setting"):
        celery_throttle.install(app, rate_limit="10/s")
    with pytest.raises(ConfigurationError, match=r"throttle_mode 'dry': use one of \('enforce', 'shadow'\)"):
        celery_throttle.install(Celery("bad-mode", broker="memory://", set_as_current=False), mode="dry")
    with pytest.raises(ConfigurationError, match=r"mode 'off': use one of"):
        celery_throttle.throttle("1/s", mode="off")
    ruled = Celery("bad-rule-mode", broker="memory://", set_as_current=False)
    ruled.conf.throttle_rules = {"x.*": {"rate": "1/s", "mode": "quiet"}}
    with pytest.raises(ConfigurationError, match=r"throttle_rules\['x\.\*'\]: mode 'quiet'"):
        celery_throttle.install(ruled).checker.rule_for("x.y")


def test_bad_rules_stop_the_worker_at_start() -> None:
    app = Celery("rules", broker="memory://", set_as_current=False)
    app.conf.throttle_rules = {"rules.*": {"rate": "10/s", "key": "{tenant_id}"}}
    celery_throttle.install(app)

    @app.task(name="rules.charge")
    def charge(customer_id):
        return customer_id

    # The worker refuses to start, naming the rule's mistake
    with pytest.raises(ConfigurationError, match=r"throttle_rules\['rules\.\*'\] for task rules\.charge: "
                                                 "key '{tenant_id}' names 'tenant_id', but the task takes"):
        ThrottleStep(SimpleNamespace(app=app))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("10/x",), {}, "bad rate"),
        (("ten/s",), {}, "bad rate"),
        (("0/s",), {}, "at least 1"),
        (("10/s",), {"algorithm": "leaky"}, "unknown algorithm"),
        (("10/s",), {"cost": 0}, "positive integer"),
        (("10/s",), {"cost": True}, "positive integer"),
        (("10/s",), {"cost": 11}, "can never fit"),
        (("10/s", "100 tokens/m"), {"cost": {"tokens": 101}}, "can never fit in rate 100 tokens/m"),
        (("10/s", "100 tokens/m"), {"cost": {"token": 5}}, r"unit\(s\) \['token'\] that no rate counts"),
        (("10/s", "100 tokens/m"), {"cost": {"tokens": 0}}, "cost of 'tokens' must be a positive integer"),
        (("10/s", "100 tokens/m"), {"cost": {}}, "names at least one unit"),
        (("10/s", "100 tokens/m"), {"cost": {"Tokens!": 3}}, "names units by their rates' names"),
        (("10 tokens per/s",), {}, "bad rate"),
        (("10/s",), {"key": "{0}"}, "must name arguments"),
        ((), {}, "a rate, a concurrency, or both"),
        ((), {"concurrency": 0}, "concurrency must be a positive integer"),
        (("10/s",), {"concurrency": "4"}, "concurrency must be a positive integer"),
        ((), {"concurrency": True}, "concurrency must be a positive integer"),
    ],
)
def test_wrong_use_fails_at_declaration(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        throttle(*args, **kwargs)


def test_key_naming_a_missing_argument_fails_at_import_in_either_order() -> None:
    app = Celery("decl", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="'tenant'"):
        @app.task
        @throttle("10/s", key="{tenant}")
        def below(tenant_id): ...

    with pytest.raises(ConfigurationError, match="'tenant'"):
        @throttle("10/s", key="{tenant}")
        @app.task
        def above(tenant_id): ...

    with pytest.raises(ConfigurationError, match="below @shared_task"):
        @throttle("10/s")
        @shared_task
        def shared(x): ...


def test_a_margin_is_checked_where_it_is_declared() -> None:
    for bad in (-1, 61, "50ms", True):
        with pytest.raises(ConfigurationError, match="margin"):
            throttle("10/s", margin=bad)
    app = Celery("margin-rules", set_as_current=False)
    with pytest.raises(ConfigurationError, match="throttle_margin"):
        celery_throttle.install(app, margin=-0.5)


def test_a_misspelt_setting_is_named_in_a_warning_with_the_likely_one(caplog: pytest.LogCaptureFixture) -> None:
    # Given an app with a misspelt throttle setting and one no version of us knows
    app = Celery("misspelt", broker="memory://", set_as_current=False)
    app.conf.update(throttle_release_intervl=5, throttle_redis_url=STORE_URL, throttle_frobnicate=True)
    # When its settings are read
    with caplog.at_level("WARNING", logger="celery_throttle"):
        settings = celery_throttle.install(app).settings
    # Then both are named as ignored, the first with the setting it resembles
    said = [r.getMessage() for r in caplog.records]
    assert ("celery_throttle: unknown setting throttle_release_intervl is ignored (did you mean "
            "throttle_release_interval?)") in said
    assert "celery_throttle: unknown setting throttle_frobnicate is ignored" in said
    assert settings.release_interval != 5


def test_misspelt_django_style_settings_are_named_in_the_spelling_given(caplog: pytest.LogCaptureFixture) -> None:
    # Given a Django project's settings, read under the CELERY namespace: one right, one
    # without its S, one namespaced wrongly (plain-Celery case, no CELERY_), one lowercase
    django_settings = SimpleNamespace(CELERY_BROKER_URL="memory://", CELERY_THROTTLE_REDIS_URL=STORE_URL,
                                      CELERY_THROTTLE_KEY_PREFIX="from-django", CELERY_THROTTLE_RULE={},
                                      THROTTLE_DEFAULT_ALGORITHM="fixed", throttle_margn=0.1)
    app = Celery("django-style", set_as_current=False)
    app.config_from_object(django_settings, namespace="CELERY")
    # When its settings are read
    with caplog.at_level("WARNING", logger="celery_throttle"):
        settings = celery_throttle.install(app).settings
    # Then the right one is read, each other is named with the nearest known setting, in
    # the spelling its family uses
    said = sorted(r.getMessage() for r in caplog.records if "unknown setting" in r.getMessage())
    assert said == [
        "celery_throttle: unknown setting CELERY_THROTTLE_RULE is ignored (did you mean CELERY_THROTTLE_RULES?)",
        ("celery_throttle: unknown setting THROTTLE_DEFAULT_ALGORITHM is ignored "
        "(did you mean CELERY_THROTTLE_DEFAULT_ALGORITHM?)"),
        "celery_throttle: unknown setting throttle_margn is ignored (did you mean throttle_margin?)",
    ]
    assert settings.key_prefix == "from-django" and settings.default_algorithm == "sliding"


def test_namespaced_settings_without_a_namespace_say_how_to_read_them(caplog: pytest.LogCaptureFixture) -> None:
    # Given CELERY_THROTTLE_* settings loaded without namespace="CELERY"
    app = Celery("no-namespace", broker="memory://", set_as_current=False)
    app.config_from_object(SimpleNamespace(CELERY_THROTTLE_KEY_PREFIX="lost", CELERY_THROTTLE_RULE={},
                                           throttle_redis_url=STORE_URL))
    with caplog.at_level("WARNING", logger="celery_throttle"):
        settings = celery_throttle.install(app).settings
    # Then they are not read, and the warning says how they would be
    said = sorted(r.getMessage() for r in caplog.records if "unknown setting" in r.getMessage())
    assert said == [
        ("celery_throttle: unknown setting CELERY_THROTTLE_KEY_PREFIX is ignored (this app has no namespace: "
        "app.config_from_object(..., namespace='CELERY') reads CELERY_THROTTLE_*, or spell it throttle_key_prefix)"),
        ("celery_throttle: unknown setting CELERY_THROTTLE_RULE is ignored (did you mean CELERY_THROTTLE_RULES? and "
        "app.config_from_object(..., namespace='CELERY') reads CELERY_THROTTLE_*)"),
    ]
    assert settings.key_prefix == "throttle"


def test_settings_of_development_versions_start_and_are_named_as_unknown(caplog: pytest.LogCaptureFixture) -> None:
    # Given an app configured for a development version: long waits parked after 5 s, a grace
    app = Celery("earlier", broker="memory://", set_as_current=False)
    app.conf.update(throttle_park_after=5, throttle_start_grace=0.1, throttle_redis_url=STORE_URL)
    # When its settings are read
    with caplog.at_level("WARNING", logger="celery_throttle"):
        celery_throttle.install(app).settings  # noqa: B018
    # Then it starts, and says that each is ignored
    said = [r.getMessage() for r in caplog.records]
    for name in ("throttle_park_after", "throttle_start_grace"):
        assert any(m.startswith(f"celery_throttle: unknown setting {name} is ignored") for m in said), said


def test_a_store_password_is_shown_by_no_celery_command_nor_the_settings() -> None:
    # Given an app whose throttle store URL holds a password
    url = "redis://:s3cret-pw@127.0.0.1:6379/12"
    app = Celery("secret", broker="memory://", set_as_current=False)
    app.conf.update(throttle_redis_url=url)
    # When the plugin reads its settings (as install, or the worker, does)
    settings = celery_throttle.install(app).settings
    # Then it connects with the URL as given
    assert settings.redis_url == url
    # and what `celery inspect conf` and `celery report` print (the conf's table and its
    # humanized form, both censored by Celery), and the settings' repr, hold no password
    shown = [str(app.conf.table(with_defaults=False)), app.conf.humanize(with_defaults=False), repr(settings),
             app.bugreport()]
    for text in shown:
        assert "s3cret-pw" not in text, text
    assert "redis://:**@127.0.0.1:6379/12" in str(app.conf.table(with_defaults=False))
    # and the settings read again (a second install, the worker's start) still connect
    from celery_throttle.core.config import Settings

    assert Settings.from_app(app).redis_url == url
