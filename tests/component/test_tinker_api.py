"""The Tinker protocol on a live API process (real Postgres/Redis), driven by the real `tinker` SDK over HTTP:
client config, sessions, server capabilities, LoRA training clients, futures, key auth and ownership, and the
clear refusal of operations not served yet.

    pytest -q tests/component/test_tinker_api.py
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil

import httpx
import pytest
from api_testlib import CONFIG_ONLY_MODEL, running_api

from tests.support.procs import wait_until
from tests.support.tiny_model import build_tiny_model

tinker = pytest.importorskip("tinker")


RATES = {"training": 0.5, "sampling_prefill": 0.2, "sampling_sample": 1.0, "storage_gb_month": 0.05}  # USD


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tinker-api")
    shutil.copytree(CONFIG_ONLY_MODEL, data_dir / "models" / "tiny-qwen")
    build_tiny_model(data_dir / "models" / "tiny-qwen2")  # with a tokenizer, for get_tokenizer
    (data_dir / "models" / "not-a-model").mkdir()  # no config.json: not offered
    with running_api(database_url, redis_url, data_dir,  # its controller stores the runs of create_model
                     TINKER_RATE_CARD=json.dumps({"default": RATES})) as live:
        live.data_dir = data_dir
        yield live


def new_token(api, scopes: list[str], name: str | None = None) -> str:
    with api.client() as admin:
        r = admin.post("/v1/tokens", json={"name": name or "tinker-" + "-".join(scopes), "scopes": scopes})
        assert r.status_code == 201, r.text
        return r.json()["token"]


OPEN: list = []  # the SDK clients of the running test


@pytest.fixture(autouse=True)
def _close_clients():
    """Each SDK client closed after its test: its session's heartbeat thread would outlive the API process and
    warn in every later test of this pytest worker."""
    yield
    while OPEN:
        with contextlib.suppress(Exception):
            OPEN.pop().close("success").result(timeout=10)


def sdk(api, token: str | None = None) -> tinker.ServiceClient:
    """A client of `api` with this key (None: configured from TINKER_BASE_URL / TINKER_API_KEY)."""
    client = tinker.ServiceClient(**({"base_url": api.url, "api_key": "tml-" + (token or api.token)} if api else {}))
    OPEN.append(client)
    return client


def capabilities(api, token: str | None = None):
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + (token or api.token))
    return rest.get_server_capabilities().result(timeout=30)


def post(api, path: str, body: dict, token: str | None = None) -> httpx.Response:
    return httpx.post(api.url + path, json=body, headers={"X-API-Key": "tml-" + (token or api.token)}, timeout=10)


def test_capabilities_list_the_model_folders_under_data_dir(api):
    caps = capabilities(api)
    tiny = json.loads((api.data_dir / "models" / "tiny-qwen2" / "config.json").read_text())
    assert [(m.model_name, m.max_context_length, m.trainable) for m in caps.supported_models] == \
        [("tiny-qwen", 32768, True), ("tiny-qwen2", tiny["max_position_embeddings"], True)]


def test_the_sdk_loads_the_tokenizer_of_a_local_base_model(api):
    training = sdk(api).create_lora_training_client(base_model="tiny-qwen2", rank=4).result(timeout=30)
    tiny = json.loads((api.data_dir / "models" / "tiny-qwen2" / "config.json").read_text())
    assert training.get_info().model_data.arch == tiny["architectures"][0]
    tokenizer = training.get_tokenizer()  # from get_info's tokenizer_id: the folder
    assert tokenizer.decode(tokenizer.encode("hello world")).strip() == "hello world"


def test_checkpoint_names_that_could_leave_their_folder_and_bad_age_recipients_are_refused(api):
    """Refused before any operation is sent: a name such as '..' would be a path outside the model's checkpoints."""
    model_id = sdk(api).create_lora_training_client(base_model="tiny-qwen2", rank=4).result(timeout=30).model_id
    for route, name in (("/api/v1/save_weights", ".."), ("/api/v1/save_weights_for_sampler", ".hidden"),
                        ("/api/v1/save_weights_external", "a/b")):
        r = post(api, route, {"model_id": model_id, "path": name, "seq_id": 1})
        assert r.status_code == 400 and r.json()["detail"][0]["field"] == "path", r.text
    r = post(api, "/api/v1/save_weights_external", {"model_id": model_id, "path": "ok", "seq_id": 1,
                                                     "age_encryption_recipients": ["age1nope"]})
    assert r.status_code == 400 and r.json()["detail"][0]["field"] == "age_encryption_recipients.0", r.text
    assert "not an age recipient" in r.json()["message"]


def test_lora_training_client_with_the_bootstrap_token(api):
    service = sdk(api)
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=8).result(timeout=30)
    info = training.get_info()
    session_id, kind, seq = info.model_id.split(":")
    assert (kind, seq) == ("train", "0")
    assert (info.is_lora, info.lora_rank, info.model_name, info.model_data.model_name) == (True, 8, "tiny-qwen",
                                                                                           "tiny-qwen")
    assert info.model_data.tokenizer_id.endswith("models/tiny-qwen")
    second = service.create_lora_training_client(base_model="tiny-qwen", rank=4).result(timeout=30)
    assert second.get_info().model_id == f"{session_id}:train:1" and second.get_info().lora_rank == 4
    with api.client() as admin:  # each training client is a flywheel run of kind tinker, owned by the key
        runs = {r["config"]["model_id"]: r for r in admin.get("/v1/runs", params={"kind": "tinker"}).json()["data"]}
        run = runs[info.model_id]
        assert (run["status"], run["config"]["base_model"], run["config"]["lora"]["rank"]) == ("running", "tiny-qwen", 8)
        assert run["config"]["owner_name"] == "API_TOKEN" and f"{session_id}:train:1" in runs
        detail = admin.get(f"/v1/runs/{run['id']}")
        assert detail.status_code == 200 and detail.json()["kind"] == "tinker", detail.text
        events = admin.get(f"/v1/runs/{run['id']}/events").json()["data"]
        assert "tinker run created by the tinker key of token 'API_TOKEN'" in [e["message"] for e in events]
        assert admin.post(f"/v1/runs/{run['id']}/pause").status_code == 409  # its client drives it
    service.close("success", detail="done").result(timeout=30)
    with api.client() as admin:  # the session's runs ended with it, as it ended
        assert {admin.get(f"/v1/runs/{r['id']}").json()["status"] for r in runs.values()
                if r["config"]["session_id"] == session_id} == {"completed"}
    beat = post(api, "/api/v1/session_heartbeat", {"session_id": session_id})
    assert beat.status_code == 410, beat.text
    refused = post(api, "/api/v1/create_model", {"session_id": session_id, "model_seq_id": 5, "base_model": "tiny-qwen",
                                                 "lora_config": {"rank": 4}})
    assert refused.status_code == 400 and "finished" in refused.json()["message"]


def test_a_sessions_runs_end_as_its_client_ended_it(api):
    """success completes the session's runs, errored fails them with the client's detail as their error,
    interrupted stops them: `SELECT status, error FROM runs` tells how each Tinker session went."""
    ended = {}
    for reason in ("success", "errored", "interrupted"):
        session_id = post(api, "/api/v1/create_session", {"tags": []}).json()["session_id"]
        made = post(api, "/api/v1/create_model", {"session_id": session_id, "model_seq_id": 0,
                                                  "base_model": "tiny-qwen", "lora_config": {"rank": 2}})
        assert made.status_code == 200, made.text
        finish = post(api, f"/api/v1/sessions/{session_id}/finish",
                      {"reason": {"type": reason}, "detail": "loss was nan" if reason == "errored" else None})
        assert finish.status_code in (200, 204), finish.text
        ended[reason] = f"{session_id}:train:0"
    with api.client() as admin:
        runs = {r["config"]["model_id"]: r for r in admin.get("/v1/runs", params={"kind": "tinker", "limit": 200})
                .json()["data"]}
    assert {reason: runs[model]["status"] for reason, model in ended.items()} == {
        "success": "completed", "errored": "failed", "interrupted": "stopped"}
    error = runs[ended["errored"]]["error"]
    assert error.startswith("its Tinker client ended session ") and error.endswith("as errored: loss was nan")
    assert runs[ended["success"]]["error"] is None


def test_a_taken_model_seq_id_is_refused(api):
    session_id = post(api, "/api/v1/create_session", {"tags": []}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-qwen", "lora_config": {"rank": 2}}
    assert post(api, "/api/v1/create_model", body).status_code == 200
    again = post(api, "/api/v1/create_model", body | {"lora_config": {"rank": 4}})
    assert again.status_code == 400 and again.json()["detail"][0]["field"] == "model_seq_id", again.text
    assert post(api, "/api/v1/get_info", {"model_id": f"{session_id}:train:0"}).json()["lora_rank"] == 2


def test_unknown_base_model_is_answered_with_the_supported_ones(api):
    with pytest.raises(tinker.BadRequestError) as e:
        sdk(api).create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result(timeout=30)
    assert "Qwen/Qwen3-8B" in str(e.value) and "supported: tiny-qwen, tiny-qwen2" in str(e.value)


def test_a_key_sees_only_its_own_sessions_models_and_futures(api):
    mine, theirs = new_token(api, ["write"]), new_token(api, ["write"])
    session_id = post(api, "/api/v1/create_session", {"tags": [], "sdk_version": "test"}, mine).json()["session_id"]
    created = post(api, "/api/v1/create_model", {"session_id": session_id, "model_seq_id": 0,
                                                 "base_model": "tiny-qwen", "lora_config": {"rank": 2}}, mine).json()
    future = post(api, "/api/v1/retrieve_future", {"request_id": created["request_id"]}, mine)
    assert future.json() == {"type": "create_model", "model_id": created["model_id"]}
    for path, body in (("/api/v1/retrieve_future", {"request_id": created["request_id"]}),
                       ("/api/v1/get_info", {"model_id": created["model_id"]}),
                       ("/api/v1/session_heartbeat", {"session_id": session_id}),
                       ("/api/v1/create_model", {"session_id": session_id, "model_seq_id": 1,
                                                 "base_model": "tiny-qwen", "lora_config": {"rank": 2}})):
        r = post(api, path, body, theirs)
        assert r.status_code == 404, (path, r.status_code, r.text)
    assert capabilities(api, theirs).supported_models
    assert post(api, "/api/v1/get_info", {"model_id": created["model_id"]}, mine).json()["lora_rank"] == 2


def test_session_listings_show_a_keys_own_sessions_with_their_models_and_samplers(api):
    mine, theirs = new_token(api, ["read", "write"]), new_token(api, ["read", "write"])
    client = sdk(api, mine)
    trained = client.create_lora_training_client(base_model="tiny-qwen", rank=2).result(timeout=60)
    other = client.create_lora_training_client(base_model="tiny-qwen", rank=2).result(timeout=60)
    sampler = client.create_sampling_client(base_model="tiny-qwen2").result(timeout=60)
    later = sdk(api, mine).create_lora_training_client(base_model="tiny-qwen", rank=2).result(timeout=60)
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + mine)
    listed = rest.list_sessions().result(timeout=30).sessions
    # newest first; a model id is <session>:train:<n>
    assert listed == [later.model_id.split(":")[0], trained.model_id.split(":")[0]]
    assert rest.list_sessions(limit=1, offset=1).result(timeout=30).sessions == listed[1:]
    session = rest.get_session(listed[1]).result(timeout=30)
    assert session.training_run_ids == sorted([trained.model_id, other.model_id])
    assert session.sampler_ids == [sampler._sampling_session_id]

    stranger = tinker.RestClient(base_url=api.url, api_key="tml-" + theirs)
    assert stranger.list_sessions().result(timeout=30).sessions == []
    r = httpx.get(f"{api.url}/api/v1/sessions/{listed[0]}", headers={"X-API-Key": "tml-" + theirs})
    assert r.status_code == 404, r.text


def test_session_search_filters_a_keys_own_sessions_newest_first_in_pages(api):
    mine, theirs = new_token(api, ["read", "write"]), new_token(api, ["read", "write"])

    def session(token, metadata, project, name):
        client = tinker.ServiceClient(metadata, project, display_name=name, base_url=api.url, api_key="tml-" + token)
        OPEN.append(client)
        return client, client.holder._session_id

    _, a = session(mine, {"team": "red"}, "proj-a", "Alpha Sweep")
    _, b = session(mine, {"team": "blue"}, None, "beta run")
    finished, c = session(mine, {"team": "red"}, None, "gamma")
    OPEN.remove(finished)
    finished.close("errored", detail="diverged").result(timeout=30)
    session(theirs, {"team": "red"}, "proj-a", "Alpha Sweep")

    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + mine)

    def search(**query):
        with pytest.warns(Warning):  # experimental in the SDK
            return rest.search_sessions(tinker.types.SessionSearchRequest(**query)).result(timeout=30)

    def ids(**query):
        return [s.session_id for s in search(**query).sessions]

    assert ids() == [c, b, a]  # newest first, the other key's session not among them
    assert ids(display_name="sweep ALPHA") == [a]  # every word, any case
    assert ids(user_metadata={"team": "red"}) == [c, a]
    assert ids(project_ids=["proj-a"]) == [a] and search(session_id=a).sessions[0].project_id == "proj-a"
    assert ids(session_id=b, display_name="gamma") == [c, b]  # either one
    assert ids(statuses=[{"type": "active"}]) == [b, a]
    assert ids(statuses=[{"type": "client_finished", "reasons": ["errored"]}]) == [c]
    assert ids(statuses=[{"type": "client_finished", "reasons": ["success"]}]) == []
    gamma = search(session_id=c).sessions[0]
    assert (gamma.status.type, gamma.status.reason.type, gamma.status.detail) == ("client_finished", "errored",
                                                                                  "diverged")
    assert (gamma.display_name, gamma.user_metadata, gamma.owner) == ("gamma", {"team": "red"}, "tinker-read-write")
    first = search(limit=2)
    assert [s.session_id for s in first.sessions] == [c, b] and first.next_cursor is not None
    second = search(limit=2, cursor=first.next_cursor)
    assert [s.session_id for s in second.sessions] == [a] and second.next_cursor is None
    assert ids(owner={"type": "accessible"}) == [c, b, a]  # a key reaches only its own

    other = tinker.RestClient(base_url=api.url, api_key="tml-" + theirs)
    with pytest.warns(Warning):
        found = other.search_sessions(tinker.types.SessionSearchRequest()).result(timeout=30).sessions
    assert len(found) == 1 and found[0].session_id not in (a, b, c)
    refused = post(api, "/api/v1/sessions/search", {"owner": {"type": "user", "owner_urns": ["u"]}}, mine)
    assert refused.status_code == 400 and refused.json()["detail"][0]["field"] == "owner", refused.text
    too_many = post(api, "/api/v1/sessions/search", {"limit": 500}, mine)
    assert too_many.status_code == 422 and too_many.json()["detail"][0]["field"] == "limit", too_many.text


def test_a_session_moved_into_a_project_is_searched_and_its_runs_listed_by_it(api):
    mine, theirs = new_token(api, ["read", "write"]), new_token(api, ["read", "write"])
    sessions = [post(api, "/api/v1/create_session", {"tags": []}, mine).json()["session_id"] for _ in range(2)]
    models = [post(api, "/api/v1/create_model", {"session_id": s, "model_seq_id": 0, "base_model": "tiny-qwen",
                                                 "lora_config": {"rank": 2}}, mine).json()["model_id"] for s in sessions]
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + mine)
    rest.assign_session_project(sessions[0], "proj-b").result(timeout=30)
    with pytest.warns(Warning):
        found = rest.search_sessions(tinker.types.SessionSearchRequest(project_ids=["proj-b"])).result(timeout=30)
    assert [(s.session_id, s.project_id) for s in found.sessions] == [(sessions[0], "proj-b")]
    runs = rest.list_training_runs(project_id="proj-b").result(timeout=30)
    assert [r.training_run_id for r in runs.training_runs] == [models[0]] and runs.cursor.total_count == 1
    assert rest.list_training_runs(project_id="proj-none").result(timeout=30).training_runs == []
    assert {models[0], models[1]} <= {r.training_run_id for r in rest.list_training_runs(limit=100).result(30).training_runs}

    stranger = tinker.RestClient(base_url=api.url, api_key="tml-" + theirs)
    with pytest.raises(tinker.NotFoundError):
        stranger.assign_session_project(sessions[1], "proj-b").result(timeout=30)
    r = httpx.put(f"{api.url}/api/v1/sessions/{sessions[1]}/project", json={"project_id": ""},
                  headers={"X-API-Key": "tml-" + mine})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "project_id", r.text
    r = httpx.get(f"{api.url}/api/v1/sessions/{sessions[1]}/trace_export", headers={"X-API-Key": "tml-" + theirs})
    assert r.status_code == 404 and f"session {sessions[1]} does not exist" in r.json()["message"], r.text


def test_keys_are_tml_plus_a_flywheel_token(api):
    for headers in ({}, {"X-API-Key": api.token}, {"X-API-Key": "tml-wrong-token"},
                    {"Authorization": f"Bearer {api.token}"}):
        r = httpx.get(api.url + "/api/v1/get_server_capabilities", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert "tml-" in r.json()["message"] + str(r.json()["detail"])
    with pytest.raises(tinker.AuthenticationError):
        capabilities(api, "wrong-token")
    read_only = new_token(api, ["read"])
    assert capabilities(api, read_only).supported_models
    r = post(api, "/api/v1/create_session", {"tags": []}, read_only)
    assert r.status_code == 403 and "'write'" in r.json()["message"]


def test_the_sdk_exchanges_its_key_for_a_jwt_that_ends_with_its_token(api):
    """The client config turns the SDK's JWT exchange on: it sends the JWT from then on, `whoami` reads it, and
    a JWT stands for its token no longer than the token lives: revoked, the SDK's next call is refused."""
    with api.client() as admin:
        made = admin.post("/v1/tokens", json={"name": "jwt-user", "scopes": ["read", "write"]}).json()
    client = sdk(api, made["token"])
    assert client.holder.get_client_config().pjwt_auth_enabled
    rest = tinker.RestClient(base_url=api.url, api_key="tml-" + made["token"])
    me = rest.whoami().result(timeout=30)  # from the claims of the JWT the SDK holds
    assert me.user_urn == "tml:user:jwt-user" and me.org_urn.startswith("tml:organization:flywheel@")
    assert client.create_lora_training_client(base_model="tiny-qwen2", rank=4).result(timeout=30).model_id
    OPEN.remove(client)
    client.close("success").result(timeout=10)  # while its token lives: revoked, its session could not end

    jwt = post(api, "/api/v1/auth/token", {}, made["token"]).json()["jwt"]
    assert jwt.startswith("eyJ")
    r = httpx.get(api.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": jwt})
    assert r.status_code == 200, r.text
    head, body, sig = jwt.split(".")
    r = httpx.get(api.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": f"{head}.{body}.{sig[:-4]}AAAA"})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"], r.text
    with api.client() as admin:
        assert admin.delete(f"/v1/tokens/{made['id']}").status_code in (200, 204)
    r = httpx.get(api.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": jwt})
    assert r.status_code == 401 and "revoked" in r.json()["message"], r.text
    with pytest.raises(tinker.AuthenticationError):  # its JWT refused, the key too when it asks for another
        rest.get_server_capabilities().result(timeout=30)


def test_the_sdk_reads_the_dynamic_config_of_this_server(api):
    holder = sdk(api, new_token(api, ["read", "write"])).holder
    dynamic = holder.get_client_dynamic_config()  # fetched at the client's start; the SDK's defaults on a 404
    assert (dynamic.refresh_interval_sec, dynamic.sample_cancel_enabled) == (3600, True)  # cancel_future: served
    r = post(api, "/api/v1/client/dynamic_config", {"sdk_version": "0.38.0"}, new_token(api, ["read"]))
    assert r.status_code == 200 and r.json()["refresh_interval_sec"] == 3600, r.text


def test_a_key_is_verified_and_revoked_by_itself_as_tinker_auth_does(api):
    import uuid

    from tinker.cli.auth_api import AuthApiError, TinkerAuthApi

    with api.client() as admin:
        made = admin.post("/v1/tokens", json={"name": "laptop", "scopes": ["read"]}).json()
    auth = TinkerAuthApi(httpx.Client(timeout=10), base_url=api.url)
    me = auth.get_self_api_key("tml-" + made["token"])
    assert (me.key_id, me.name, me.details.user_details.email) == (uuid.UUID(made["id"]).int, "laptop", "laptop")
    assert "scopes read" in me.note and me.details.org_details.name.startswith("flywheel at ")
    bootstrap = auth.get_self_api_key("tml-" + api.token)
    assert (bootstrap.key_id, bootstrap.name) == (0, "API_TOKEN")
    with pytest.raises(AuthApiError, match="HTTP 401"):
        auth.get_self_api_key("tml-fw_not-a-token")

    auth.delete_self_api_key("tml-" + made["token"])  # a read-only key may revoke itself
    with pytest.raises(AuthApiError, match="HTTP 401"):
        auth.get_self_api_key("tml-" + made["token"])
    with pytest.raises(tinker.AuthenticationError):
        capabilities(api, made["token"])
    with api.client() as admin:
        row = next(t for t in admin.get("/v1/tokens").json()["data"] if t["id"] == made["id"])
        assert row["revoked_at"] is not None

    r = httpx.delete(api.url + "/api/v1/auth/apikey/me", headers={"X-API-Key": "tml-" + api.token})
    assert r.status_code == 400 and "API_TOKEN" in r.json()["message"] and "cannot be revoked" in r.json()["message"]
    assert auth.get_self_api_key("tml-" + api.token).name == "API_TOKEN"  # still valid


def test_a_signed_download_url_serves_only_what_it_was_signed_for_until_it_expires(api, redis_url):
    """The API checks a download URL's HMAC under the deployment's key (kept in Redis), then its expiry, then
    that the export exists; a URL it did not sign is refused before anything is looked up."""
    import time

    import redis

    from services.api.signing import signature

    where = "external_weights/s%3Atrain%3A0/final/adapter_model.safetensors"  # the path under /api/v1, as signed
    url = api.url + "/api/v1/" + where
    r = httpx.get(url, params={"expires": int(time.time()) + 60, "signature": "0" * 64})
    assert r.status_code == 403 and "signature does not match" in r.json()["message"], r.text
    key = bytes.fromhex(redis.Redis.from_url(redis_url).get("signing:url_key").decode())  # made on first use
    past, future = int(time.time()) - 1, int(time.time()) + 60
    r = httpx.get(url, params={"expires": past, "signature": signature(key, where, past)})
    assert r.status_code == 403 and "expired" in r.json()["message"], r.text
    r = httpx.get(url, params={"expires": future, "signature": signature(key, where, future)})
    assert r.status_code == 404 and "deleted, or past its ttl" in r.json()["message"], r.text
    r = httpx.get(api.url + "/api/v1/training_runs/x/checkpoints/weights/y/external_weights_urls",
                  headers={"X-API-Key": "tml-" + api.token})
    assert r.status_code == 404 and "model x does not exist" in r.json()["message"], r.text


def test_operations_not_served_yet_say_so(api):
    for path, operation in (("/api/v1/create_custom_loss", "create_custom_loss"),):
        r = post(api, path, {})
        assert r.status_code == 404, r.text
        assert operation in r.json()["message"] and "not supported by this flywheel server yet" in r.json()["message"]


def saved_checkpoint(api, redis_url, token: str, name: str, kind: str = "weights",
                     size_bytes: int | None = None) -> tuple[str, str]:
    """A model of this key and a checkpoint record of it as the trainer writes one: (model id, tinker path)."""
    import hashlib
    import time

    import redis

    from shared.contracts.messages import TinkerCheckpoint
    from shared.contracts.streams import tinker_key

    session_id = post(api, "/api/v1/create_session", {"tags": []}, token).json()["session_id"]
    model_id = post(api, "/api/v1/create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-qwen",
                                                  "lora_config": {"rank": 4}}, token).json()["model_id"]
    path = f"tinker://{model_id}/{kind}/{name}"
    with api.client() as admin:
        runs = admin.get("/v1/runs", params={"kind": "tinker", "limit": 200}).json()["data"]
    run_id = next(r["id"] for r in runs if r["name"] == f"tinker {model_id}")
    record = TinkerCheckpoint(owner=hashlib.sha256(token.encode()).hexdigest(), model_id=model_id, run_id=run_id,
                              kind=kind, name=name, base_model="tiny-qwen", lora={"rank": 4}, seq_id=1,
                              folder="/nowhere" if kind == "weights" else None,
                              version=None if kind == "weights" else 1, created_at=time.time(),
                              size_bytes=size_bytes)
    redis.Redis.from_url(redis_url).set(tinker_key("checkpoint", path), record.model_dump_json())
    return model_id, path


def test_only_the_owner_publishes_a_checkpoint_and_the_listings_show_it(api, redis_url):
    owner_key, eve_key = new_token(api, ["read", "write"]), new_token(api, ["read", "write"])
    model_id, path = saved_checkpoint(api, redis_url, owner_key, "pub")
    owner = tinker.RestClient(base_url=api.url, api_key="tml-" + owner_key)
    eve = tinker.RestClient(base_url=api.url, api_key="tml-" + eve_key)

    def public() -> bool:
        return {c.tinker_path: c.public for c in owner.list_user_checkpoints().result(timeout=30).checkpoints}[path]

    with pytest.raises(tinker.NotFoundError):
        eve.get_weights_info_by_tinker_path(path).result(timeout=30)
    with pytest.raises(tinker.NotFoundError):
        eve.publish_checkpoint_from_tinker_path(path).result(timeout=30)
    assert public() is False
    owner.publish_checkpoint_from_tinker_path(path).result(timeout=30)
    assert public() is True and owner.get_training_run(model_id).result(timeout=30).last_checkpoint.public
    assert eve.get_weights_info_by_tinker_path(path).result(timeout=30).lora_rank == 4
    assert eve.list_user_checkpoints().result(timeout=30).checkpoints == []  # listed only for its owner
    with pytest.raises(tinker.NotFoundError):  # publishing lets her read it, not unpublish it
        eve.unpublish_checkpoint_from_tinker_path(path).result(timeout=30)
    owner.unpublish_checkpoint_from_tinker_path(path).result(timeout=30)
    assert public() is False
    with pytest.raises(tinker.NotFoundError):
        eve.get_weights_info_by_tinker_path(path).result(timeout=30)
    r = httpx.post(f"{api.url}/api/v1/training_runs/{model_id}/checkpoints/weights/missing/publish",
                   headers={"X-API-Key": "tml-" + owner_key})
    assert r.status_code == 404 and r.json()["detail"][0]["field"] == "path.checkpoint_id", r.text


def test_copy_weights_copies_checkpoints_into_a_slot_that_cannot_be_trained(api, redis_url):
    owner_key, eve_key = new_token(api, ["read", "write"]), new_token(api, ["read", "write"])
    _, source = saved_checkpoint(api, redis_url, owner_key, "s1", "sampler_weights")
    _, state = saved_checkpoint(api, redis_url, owner_key, "w1")
    owner = tinker.RestClient(base_url=api.url, api_key="tml-" + owner_key)

    copied = owner.copy_weights(source, "proj-archive", ttl_seconds=7200).result(timeout=30)
    model_id = copied.removeprefix("tinker://").split("/")[0]
    assert copied == f"tinker://{model_id}/sampler_weights/s1" and model_id.endswith(":train:0")
    listed = {c.tinker_path: c for c in owner.list_user_checkpoints().result(timeout=30).checkpoints}
    assert source in listed and listed[copied].expires_at is not None and listed[source].expires_at is None
    assert [c.tinker_path for c in owner.list_checkpoints(model_id).result(timeout=30).checkpoints] == [copied]
    with pytest.warns(Warning):  # a new session, in the project
        found = owner.search_sessions(tinker.types.SessionSearchRequest(project_ids=["proj-archive"])).result(30)
    assert [s.session_id for s in found.sessions] == [model_id.split(":")[0]]
    assert owner.get_weights_info_by_tinker_path(copied).result(timeout=30).lora_rank == 4
    session_id = post(api, "/api/v1/create_session", {"tags": []}, owner_key).json()["session_id"]
    made = post(api, "/api/v1/create_sampling_session", {"session_id": session_id, "sampling_session_seq_id": 0,
                                                          "model_path": copied}, owner_key)
    assert made.status_code == 200, made.text  # sampled like its source
    trained = post(api, "/api/v1/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}},
                   owner_key)
    assert trained.status_code == 400 and "cannot be trained on" in trained.json()["message"], trained.text

    into = {"source_path": source, "session_id": session_id, "model_seq_id": 3}
    replay = {"X-Idempotency-Key": "copy-once"}
    first = httpx.post(api.url + "/api/v1/copy_weights", json=into, headers={"X-API-Key": "tml-" + owner_key} | replay)
    assert first.json() == {"tinker_path": f"tinker://{session_id}:train:3/sampler_weights/s1"}, first.text
    again = httpx.post(api.url + "/api/v1/copy_weights", json=into, headers={"X-API-Key": "tml-" + owner_key} | replay)
    assert again.json() == first.json()  # a retry gets the copy the first made
    taken = post(api, "/api/v1/copy_weights", into, owner_key)
    assert taken.status_code == 400 and taken.json()["detail"][0]["field"] == "model_seq_id", taken.text
    weights = post(api, "/api/v1/copy_weights", {"source_path": state, "destination_project_id": "p"}, owner_key)
    assert weights.status_code == 200 and weights.json()["tinker_path"].endswith("/weights/w1"), weights.text
    state_copy = owner.get_weights_info_by_tinker_path(weights.json()["tinker_path"]).result(timeout=30)
    assert state_copy.lora_rank == owner.get_weights_info_by_tinker_path(state).result(timeout=30).lora_rank
    nowhere = post(api, "/api/v1/copy_weights", {"source_path": source}, owner_key)
    assert nowhere.status_code == 400 and nowhere.json()["detail"][0]["field"] == "destination_project_id"

    owner.delete_checkpoint_from_tinker_path(copied).result(timeout=30)  # the source stays
    assert source in {c.tinker_path for c in owner.list_user_checkpoints().result(timeout=30).checkpoints}
    eve = tinker.RestClient(base_url=api.url, api_key="tml-" + eve_key)
    with pytest.raises(tinker.NotFoundError):  # not hers until published
        eve.copy_weights(source, "eve-proj").result(timeout=30)
    owner.publish_checkpoint_from_tinker_path(source).result(timeout=30)
    hers = eve.copy_weights(source, "eve-proj").result(timeout=30)
    assert [c.tinker_path for c in eve.list_user_checkpoints().result(timeout=30).checkpoints] == [hers]


def test_the_audit_log_shows_what_was_done_to_a_keys_checkpoints_and_by_whom(api, redis_url):
    owner_key, eve_key = new_token(api, ["read", "write"], "audit-owner"), new_token(api, ["read", "write"], "audit-eve")
    model_id, source = saved_checkpoint(api, redis_url, owner_key, "a1", "sampler_weights")
    owner = tinker.RestClient(base_url=api.url, api_key="tml-" + owner_key)
    eve = tinker.RestClient(base_url=api.url, api_key="tml-" + eve_key)
    owner.publish_checkpoint_from_tinker_path(source).result(timeout=30)
    hers = eve.copy_weights(source, "eve-proj").result(timeout=30)
    owner.assign_session_project(model_id.split(":")[0], "p1").result(timeout=30)
    owner.set_checkpoint_ttl_from_tinker_path(source, 3600).result(timeout=30)
    owner.delete_checkpoint_from_tinker_path(source).result(timeout=30)

    def log(key: str, **kw) -> list:
        return tinker.AdminClient(base_url=api.url, api_key="tml-" + key).get_audit_log(**kw).result(timeout=30).entries

    mine = log(owner_key)
    assert [e.event for e in mine] == ["checkpoint_publish", "checkpoint_read", "project_session_assigned",
                                       "checkpoint_ttl_set", "checkpoint_delete"]
    assert {e.event_details["actor"] for e in mine} == {"audit-owner", "audit-eve"}
    read = mine[1]  # eve's copy is a read of the owner's checkpoint, in the owner's log and in hers
    assert read.event_details["actor"] == "audit-eve" and read.purpose == "copy" and read.tinker_path == source
    assert read.event_details["copy"] == hers and read.model_id == model_id
    assert mine[2].event_details == {"actor": "audit-owner", "session_id": model_id.split(":")[0], "project_id": "p1",
                                     "previous_project_id": None}
    assert mine[3].event_details["ttl_seconds"] == 3600
    assert [(e.event, e.timestamp) for e in log(eve_key)] == [(read.event, read.timestamp)]  # not the owner's acts
    assert [e.event for e in log(owner_key, event_type="projects")] == ["project_session_assigned"]
    assert len(log(owner_key, event_type="checkpoints")) == 4
    assert log(owner_key, day=datetime.datetime.now(datetime.UTC).date() - datetime.timedelta(days=1)) == []


def test_usage_is_reported_per_hour_session_and_base_model_each_request_counted_once(api, redis_url):
    """What the trainer and the rollout workers count (shared/stores/tinker_usage.py count_once), through the
    SDK's AdminClient: a request answered twice counts once; another key's usage is not shown; bad windows are
    400s naming the field. And the stored checkpoints, per project."""
    import hashlib
    import time
    from datetime import UTC, timedelta

    import redis

    from shared.contracts.messages import TinkerCheckpoint
    from shared.contracts.streams import tinker_key
    from shared.stores.tinker_usage import count_once, count_storage_once

    token = new_token(api, ["read", "write"], name="billed")
    owner = hashlib.sha256(token.encode()).hexdigest()
    session_id = post(api, "/api/v1/create_session", {"tags": [], "user_metadata": {"team": "rl"}},
                      token).json()["session_id"]
    client = redis.Redis.from_url(redis_url)
    hour = (int(time.time()) // 3600 - 2) * 3600  # two hours ago: a window of earlier hours
    for request_id, counts, at in (("fb-1", {"training": 300}, hour + 10), ("fb-1", {"training": 300}, hour + 20),
                                   ("fb-2", {"training": 200}, hour + 3599), ("save-1", {"checkpoint": 1}, hour + 5),
                                   ("s-1", {"sampling_prefill": 40, "sampling_prefill_cached": 24,
                                            "sampling_sample": 64}, hour + 3600 + 1)):
        count_once(client, owner, request_id, session_id, "tiny-qwen", counts, at)
    count_once(client, hashlib.sha256(api.token.encode()).hexdigest(), "other", "s", "tiny-qwen",
               {"training": 7}, hour)  # another key's
    # storage: a checkpoint the trainer removed (counted then), one still held since half past the first hour
    count_storage_once(client, owner, f"gone-{owner}", "tiny-qwen", 10**9, hour, hour + 3600)
    held_path = f"tinker://{session_id}:train:9/sampler_weights/held"
    client.set(tinker_key("checkpoint", held_path), TinkerCheckpoint(
        owner=owner, model_id=f"{session_id}:train:9", run_id="r", kind="sampler_weights", name="held",
        base_model="tiny-qwen", lora={"rank": 4}, seq_id=1, version=1, created_at=hour + 1800,
        size_bytes=3_600_000_000).model_dump_json())
    admin = tinker.AdminClient(base_url=api.url, api_key="tml-" + token)
    start = datetime.datetime.fromtimestamp(hour, UTC)
    got = admin.get_billing_usage(start, start + timedelta(hours=3)).result(timeout=30)
    client.delete(tinker_key("checkpoint", held_path))
    storage = [(e.bucket_start, e.event_info.gigabyte_hours, e.session_id) for e in got.data
               if e.event_info.type == "storage"]
    assert storage[:2] == [(start, pytest.approx(2.8), None), (start + timedelta(hours=1), pytest.approx(3.6), None)]
    assert len(storage) == 3 and 0 < storage[2][1] <= 3.6  # the hour going on, so far
    rows = [(e.bucket_start, e.event_info.type, getattr(e.event_info, "token_count", None) or e.event_info.count,
             e.session_id, e.base_model) for e in got.data if e.event_info.type != "storage"]
    later = start + timedelta(hours=1)
    assert rows == [(start, "training", 500, session_id, "tiny-qwen"), (start, "checkpoint", 1, session_id, "tiny-qwen"),
                    (later, "sampling_sample", 64, session_id, "tiny-qwen"),
                    (later, "sampling_prefill", 40, session_id, "tiny-qwen"),
                    (later, "sampling_prefill", 24, session_id, "tiny-qwen")]
    assert [e.event_info.cached for e in got.data if e.event_info.type == "sampling_prefill"] == [False, True]
    assert all(e.user_name == "billed" for e in got.data)
    # priced by the rate card: tokens per million, storage per GB-month of 720 hours, checkpoints not at all
    rates = {"training": 0.5, "sampling_sample": 1.0, "sampling_prefill": 0.2, "checkpoint": None}
    for e in got.data:
        quantity = getattr(e.event_info, "token_count", None) or getattr(e.event_info, "gigabyte_hours", None)
        if e.event_info.type == "storage":
            assert e.effective_rate_usd_per_gigabyte_month == 0.05
            assert e.estimated_cost_usd == pytest.approx(0.05 * quantity / 720)
        elif rates[e.event_info.type] is None:
            assert e.estimated_cost_usd is None and e.effective_rate_usd_per_million_tokens is None
        else:  # cached prefill: prefill's rate, none set apart
            assert e.effective_rate_usd_per_million_tokens == rates[e.event_info.type]
            assert e.estimated_cost_usd == pytest.approx(rates[e.event_info.type] * quantity / 1e6)
    assert got.sessions[session_id].user_metadata == {"team": "rl"}
    assert admin.get_billing_usage(later, later + timedelta(hours=1)).result(timeout=30).data[0].event_info.type \
        == "sampling_sample"
    for starting, ending, field in ((start + timedelta(minutes=30), later, "starting_on"),
                                    (start, start + timedelta(days=15), "ending_before"),
                                    (start, start, "ending_before"),
                                    (start + timedelta(days=2), start + timedelta(days=3), "starting_on")):
        r = httpx.get(api.url + "/api/v1/billing/usage/events", headers={"X-API-Key": "tml-" + token},
                      params={"starting_on": starting.isoformat(), "ending_before": ending.isoformat()})
        assert r.status_code == 400 and r.json()["detail"][0]["field"] == field, (starting, ending, r.text)

    assert admin.get_current_checkpoint_storage_usage().result(timeout=30).data == []
    model_id, _ = saved_checkpoint(api, redis_url, token, "stored", size_bytes=1234)
    saved_checkpoint(api, redis_url, token, "old record")  # written before sizes were kept: counted, no bytes
    [row] = admin.get_current_checkpoint_storage_usage().result(timeout=30).data
    assert (row.checkpoint_count, row.size_bytes, row.project_id) == (2, 1234, None), row
    r = httpx.put(f"{api.url}/api/v1/sessions/{model_id.split(':')[0]}/project", json={"project_id": "p1"},
                  headers={"X-API-Key": "tml-" + token})
    assert r.status_code == 204, r.text
    rows = admin.get_current_checkpoint_storage_usage().result(timeout=30).data
    assert [(r.project_id, r.checkpoint_count, r.size_bytes) for r in rows] == [(None, 1, 0), ("p1", 1, 1234)]
    assert [r.estimated_monthly_cost_usd for r in rows] == [0.0, pytest.approx(0.05 * 1234 / 1e9)]
    [p1] = admin.get_current_checkpoint_storage_usage(project_id="p1").result(timeout=30).data
    assert (p1.size_bytes, p1.size_gigabytes) == (1234, 1234 / 1e9)
    assert admin.get_current_checkpoint_storage_usage(project_id="elsewhere").result(timeout=30).data == []


def test_sdk_telemetry_is_counted_and_a_client_exception_logged(api):
    from datetime import UTC, datetime

    from tinker import types

    now = datetime.now(UTC)
    batch = types.TelemetrySendRequest(session_id="s-1", platform="linux", sdk_version="0.38.0", process_uuid="p", events=[
        types.SessionStartEvent(event="SESSION_START", event_id="e1", event_session_index=0, severity="INFO",
                                timestamp=now),
        types.UnhandledExceptionEvent(event="UNHANDLED_EXCEPTION", event_id="e2", event_session_index=1,
                                      severity="ERROR", timestamp=now, error_type="ValueError",
                                      error_message="telemetry-probe-7f3a", traceback="Traceback: probe")])
    r = post(api, "/api/v1/telemetry", batch.model_dump(mode="json", exclude_none=True),
             new_token(api, ["read"]))  # a read-only key may report too
    assert r.status_code == 200 and r.json() == {"status": "accepted"}, r.text
    metrics = httpx.get(api.url + "/metrics").text
    assert 'tinker_client_events_total{event="UNHANDLED_EXCEPTION",severity="ERROR"} 1.0' in metrics
    wait_until(lambda: "telemetry-probe-7f3a" in (api.data_dir / "api.log").read_text(), timeout_s=10,
               what="the client exception in the API log")


def test_the_sdk_configured_from_its_environment(api, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", api.url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-" + api.token)
    training = sdk(None).create_lora_training_client(base_model="tiny-qwen", rank=2).result(timeout=30)
    assert training.get_info().lora_rank == 2


def test_a_future_not_done_is_long_polled_until_its_result_arrives(api, redis_url):
    """retrieve_future holds a future that is not done until the worker writes its result (the SDK polls again
    at once after each try_again: answered at once, every waiting client would spin on the API)."""
    import hashlib
    import threading
    import time

    import redis

    from shared.contracts.messages import TinkerFuture
    from shared.contracts.streams import tinker_key

    owner = hashlib.sha256(api.token.encode()).hexdigest()
    client = redis.Redis.from_url(redis_url)
    key = tinker_key("future", "long-polled")
    waiting = {"type": "try_again", "request_id": "long-polled", "queue_state": "active"}
    client.set(key, TinkerFuture(owner=owner, result=waiting).model_dump_json(), ex=60)

    def finish() -> None:
        time.sleep(1.0)
        client.set(key, TinkerFuture(owner=owner, result={"type": "optim_step", "metrics": {}}).model_dump_json(),
                   ex=60)

    threading.Thread(target=finish).start()
    started = time.monotonic()
    r = post(api, "/api/v1/retrieve_future", {"request_id": "long-polled"})
    assert r.status_code == 200 and r.json()["type"] == "optim_step", r.text  # one poll, answered with the result
    assert time.monotonic() - started >= 0.9


def test_an_abandoned_sample_is_cancelled_on_the_server(api, redis_url):
    """The SDK cancels a sample its caller abandoned (`cancel_future`): the future answers that it was cancelled
    and the rollout workers' marker is set. Only the owner cancels; an answered future keeps its answer; a
    training operation is not withdrawn."""
    import hashlib

    import redis

    from shared.contracts.messages import TinkerFuture
    from shared.contracts.streams import tinker_key

    token = new_token(api, ["read", "write"])
    sampler = sdk(api, token).create_sampling_client(base_model="tiny-qwen2").result(timeout=30)
    sample = sampler.sample(tinker.types.ModelInput.from_ints([5, 6, 7]), 1, tinker.types.SamplingParams(max_tokens=4))
    with pytest.raises(TimeoutError):  # no rollout worker in this module: the sample waits
        sample.result(timeout=2)
    client = redis.Redis.from_url(redis_url)
    earlier = {k.decode() for k in client.scan_iter("tinker:cancelled:*")}  # another module's, on this database
    sample.future().cancel()  # the caller gives up on it, as asyncio.wait_for's timeout does

    def marked() -> list[str]:  # the request ids the rollout workers are told to drop
        return [k.decode().removeprefix(tinker_key("cancelled", "")) for k in client.scan_iter("tinker:cancelled:*")
                if k.decode() not in earlier]

    (request_id,) = wait_until(marked, 30, "the SDK's cancel_future")
    r = post(api, "/api/v1/retrieve_future", {"request_id": request_id}, token)
    assert r.status_code == 200 and "cancelled" in r.json()["error"] and r.json()["category"] == "user", r.text

    other = post(api, "/api/v1/cancel_future", {"request_id": request_id}, new_token(api, ["read", "write"]))
    assert other.status_code == 404, other.text  # another key's future reads as absent
    again = post(api, "/api/v1/cancel_future", {"request_id": request_id}, token)
    assert again.status_code == 200, again.text  # cancelling twice is harmless (the SDK retries)

    owner = hashlib.sha256(token.encode()).hexdigest()
    answered = {"type": "sample", "sequences": []}
    client.set(tinker_key("future", "answered"), TinkerFuture(owner=owner, result=answered).model_dump_json(), ex=60)
    assert post(api, "/api/v1/cancel_future", {"request_id": "answered"}, token).status_code == 200
    assert json.loads(client.get(tinker_key("future", "answered")))["result"] == answered
    assert not client.exists(tinker_key("cancelled", "answered"))

    session_id = post(api, "/api/v1/create_session", {"tags": []}, token).json()["session_id"]
    model_id = post(api, "/api/v1/create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-qwen",
                                                  "lora_config": {"rank": 2}}, token).json()["model_id"]
    step = post(api, "/api/v1/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}, token)
    r = post(api, "/api/v1/cancel_future", {"request_id": step.json()["request_id"]}, token)
    assert r.status_code == 400 and "training operation" in r.json()["message"], r.text
