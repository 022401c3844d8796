"""Start-up config logging masks secrets: URL passwords and token/password/secret/key fields."""

from shared.platform.settings import ServiceSettings, mask_url


class WithSecrets(ServiceSettings):
    api_token: str | None = None
    s3_secret_access_key: str = ""
    wandb_api_key: str | None = None


def test_loggable_masks_every_secret_and_keeps_the_rest():
    cfg = WithSecrets(database_url="postgresql://flywheel:pg-pass-1@db:5432/flywheel",
                      redis_url="redis://:redis-pass-2@redis:6379/0", api_token="tok-3",
                      s3_secret_access_key="s3-4", wandb_api_key="wb-5", service_name="api")
    logged = cfg.loggable()
    text = repr(logged)
    for secret in ("pg-pass-1", "redis-pass-2", "tok-3", "s3-4", "wb-5"):
        assert secret not in text
    assert logged["database_url"] == "postgresql+psycopg://flywheel:***@db:5432/flywheel"
    assert logged["service_name"] == "api" and logged["api_token"] == "***"


def test_mask_url_leaves_urls_without_password_alone():
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_url("unix:///tmp/redis.sock?db=0") == "unix:///tmp/redis.sock?db=0"


def test_a_service_logs_its_config_once_at_start_masked(capsys):
    import logging

    from shared.platform.service import setup_service

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_service(WithSecrets(service_name="probe", log_format="text", api_token="tok-6",
                                  database_url="postgresql://u:pg-pass-7@db/x"))
    finally:
        root.handlers[:], root.level = handlers, level
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "[probe] probe config: {" in lines[0]
    assert "'api_token': '***'" in lines[0] and "u:***@db" in lines[0]
    assert "tok-6" not in lines[0] and "pg-pass-7" not in lines[0]
