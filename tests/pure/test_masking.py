"""The store's password in no setting Celery shows, no repr and no error (issue 44, item 6).

The real commands (``celery report``, ``celery inspect conf``, ``throttle doctor``) run in
tests/workers/test_secrets.py; these are the parts they rest on.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import MasterNotFoundError

import celery_throttle
from celery_throttle.core.config import Settings
from celery_throttle.core.errors import ConfigurationError, StoreError
from celery_throttle.core.urls import safe_url, scrub, secrets_of
from celery_throttle.store.scripts import ScriptClient

URL = "redis://:s3cret-pw@127.0.0.1:6379/12"


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret-pw@h:6379/0", "redis://:**@h:6379/0"),
    ("rediss://user:s3cret-pw@h/0", "rediss://user:**@h/0"),
    ("redis+cluster://:s3cret-pw@h:7000", "redis+cluster://:**@h:7000"),
    ("redis+sentinel://u:s3cret-pw@h:26379/mymaster/0", "redis+sentinel://u:**@h:26379/mymaster/0"),
    # every Sentinel of a list, written with spaces or not (connection.py reads both)
    ("sentinel://:s3cret-pw@h1:26379; sentinel://:s3cret-pw@h2:26379",
     "sentinel://:**@h1:26379;sentinel://:**@h2:26379"),
    # redis-py passes every query parameter to its connection: ?password= is one
    ("unix:///tmp/r.sock?db=0&password=s3cret-pw", "unix:///tmp/r.sock?db=0&password=**"),
    ("redis://h:6379/0?password=s3cret-pw", "redis://h:6379/0?password=**"),
    ("redis://:s3cret%40pw@h/0", "redis://:**@h/0"),
    ("redis://:s3cret-pw@[::1/0", "redis://**"),  # unreadable: nothing past the scheme
    ("redis://127.0.0.1:6379/12", "redis://127.0.0.1:6379/12"),
])
def test_a_store_url_is_shown_with_every_secret_masked(url: str, shown: str) -> None:
    assert safe_url(url) == shown
    assert "s3cret" not in safe_url(url)


def test_the_secrets_of_a_store_are_found_in_its_url_and_options_and_scrubbed() -> None:
    found = secrets_of("sentinel://:url-pw@h1:26379;sentinel://:p%40ss@h2:26379",
                       {"password": "opt-pw", "sentinel_kwargs": {"password": b"sk-pw"}, "socket_timeout": 1,
                        "ssl_password": "tls-pw", "username": "throttler"})
    assert found == {"url-pw", "p%40ss", "p@ss", "opt-pw", "sk-pw", "tls-pw"}
    # A client's repr as redis-py 6.2 to 7.2 wrote it, in the error a Sentinel gives
    text = ("No master found for 'm' : <redis.client.Redis(<redis.connection.ConnectionPool(<redis.connection."
            "Connection(host=h1,port=26379,password=sk-pw,socket_timeout=1)>)>)> - ConnectionError('x')")
    assert "sk-pw" not in scrub(text, found) and "host=h1,port=26379" in scrub(text, found)
    assert "password=**" in scrub(text)  # (by its name, even a secret not given)


def test_settings_read_after_install_use_the_url_that_celery_shows_masked() -> None:
    # Given an app whose configuration is loaded after install (a config object, as Django's)
    app = Celery("secret-namespace", set_as_current=False)
    app.config_from_object({"CELERY_BROKER_URL": "memory://", "CELERY_THROTTLE_REDIS_URL": URL,
                            "CELERY_THROTTLE_REDIS_OPTIONS": {"password": "s3cret-opt",
                                                              "sentinel_kwargs": {"password": "s3cret-sk"}}},
                           namespace="CELERY")
    celery_throttle.install(app)
    # When Celery shows the configuration (what `celery report` and `inspect conf` print),
    # before anything read the throttle's settings
    shown = [app.bugreport(), str(app.conf.table(with_defaults=True))]
    # Then no secret is in it, under the namespace's spelling either
    for text in shown:
        assert "s3cret" not in text, text
    assert "CELERY_THROTTLE_REDIS_URL: 'redis://:**@127.0.0.1:6379/12'" in shown[0]
    # and the settings connect with the URL as given; their repr shows neither
    settings = Settings.from_app(app)
    assert settings.redis_url == URL and settings.redis_options["password"] == "s3cret-opt"
    assert "s3cret" not in repr(settings)


def test_a_url_set_after_install_is_masked_before_a_celery_command_runs() -> None:
    # Given an app configured, then installed, then given its store URL
    app = Celery("secret-after", broker="memory://", set_as_current=False)
    _ = app.conf.broker_url
    celery_throttle.install(app)
    app.conf.throttle_redis_url = URL
    # When a celery command imports the task modules (report and worker do, first)
    app.loader.import_default_modules()
    # Then the report holds no password, and the settings still connect with it
    assert "s3cret" not in app.bugreport()
    assert Settings.from_app(app).redis_url == URL


def test_a_config_source_loaded_again_gives_its_new_url() -> None:
    # Given an app whose store URL (a password's) came from a config source, masked
    app = Celery("secret-reload", set_as_current=False)
    app.config_from_object({"broker_url": "memory://", "throttle_redis_url": URL})
    celery_throttle.install(app)
    assert Settings.from_app(app).redis_url == URL and "s3cret-pw" not in app.bugreport()
    # When another source is loaded in its place (config_from_object again)
    other = URL.replace("s3cret-pw", "s3cret-two")
    app.config_from_object({"broker_url": "memory://", "throttle_redis_url": other}, force=True)
    # Then the settings use its URL (the masked one written before does not hide it), masked
    assert Settings.from_app(app).redis_url == other
    assert "s3cret" not in app.bugreport()


def test_a_url_of_the_wrong_type_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigurationError) as refused:
        Settings(redis_url=URL.encode()).validated()  # type: ignore[arg-type]
    assert "s3cret" not in str(refused.value) and "bytes" in str(refused.value)


@pytest.mark.parametrize("error", [
    # redis-py 6.2 to 7.2: a Sentinel that answers no master is named by its client's repr,
    # which wrote its password (redis-py #3993)
    MasterNotFoundError("No master found for 'mymaster' : <redis.client.Redis(<redis.connection.ConnectionPool("
                        "<redis.connection.Connection(host=127.0.0.1,port=26379,password=s3cret-sk)>)>)> - "
                        "ConnectionError('Error 111 connecting to 127.0.0.1:26379. Connection refused.')"),
    RedisConnectionError("Error connecting with password s3cret-opt"),  # (any message that quotes one)
], ids=["sentinel-repr", "quoted"])
def test_a_store_error_carries_no_secret_of_the_store_nor_does_its_cause(error: Exception) -> None:
    store = ScriptClient("sentinel://:s3cret-url@127.0.0.1:26379", "ct-test-secret",
                         options={"master_name": "mymaster", "password": "s3cret-opt",
                                  "sentinel_kwargs": {"password": "s3cret-sk"}})
    # When a Redis error comes through the store
    with pytest.raises(StoreError) as failure, store.errors():
        raise error
    # Then what a log line shows of it (its str, its repr, the traceback's cause) holds no secret
    shown: list[Any] = [str(failure.value), repr(failure.value), str(failure.value.__cause__),
                        repr(failure.value.__cause__)]
    for text in shown:
        assert "s3cret" not in text, text
    assert str(failure.value).startswith("Redis at sentinel://:**@127.0.0.1:26379 failed: ")
