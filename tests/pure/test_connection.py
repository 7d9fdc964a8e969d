"""The store's URL: a scheme no store has is refused at install, naming the setting, and a
Sentinel URL's path is read as its group's name and database, or refused as neither. No
connection is made (a Sentinel client connects on its first call)."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_throttle
from celery_throttle.core.errors import ConfigurationError
from celery_throttle.store.connection import connect


@pytest.mark.parametrize("url", ["nosuch://127.0.0.1:6379/0", "127.0.0.1:6379", "http://127.0.0.1/", ""])
def test_a_store_url_of_no_store_scheme_is_refused_at_install(url: str) -> None:
    app = Celery("bad-url", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="throttle_redis_url"):
        celery_throttle.install(app, redis_url=url or "x")


def test_a_store_url_with_a_password_is_refused_without_showing_it() -> None:
    app = Celery("bad-url-secret", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError) as raised:
        celery_throttle.install(app, redis_url="nosuch://user:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in str(raised.value)


@pytest.mark.parametrize("path", ["/mymaster/abc", "/mymaster/\u00b2", "/mymaster/1x"])
def test_a_sentinel_path_that_holds_no_database_number_is_refused(path: str) -> None:
    with pytest.raises(ConfigurationError, match="database number"):
        connect(f"redis+sentinel://127.0.0.1:1{path}")


def test_a_sentinel_path_names_the_group_and_its_database_and_the_option_wins() -> None:
    client = connect("redis+sentinel://127.0.0.1:1/mymaster/3")
    assert client.connection_pool.service_name == "mymaster"
    assert client.connection_pool.connection_kwargs["db"] == 3
    named = connect("redis+sentinel://127.0.0.1:1/mymaster/4", {"master_name": "other"})
    assert named.connection_pool.service_name == "other"
    assert named.connection_pool.connection_kwargs["db"] == 4
