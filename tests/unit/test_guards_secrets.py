"""The `secrets` input check (docs/tenants-and-guards.md, "Guardrails"): each kind of credential found, blocked,
redacted (and restored) or flagged, on every way into a prompt, embedded and remote, never reaching the engine or the
upstream and never logged; and ordinary text, ids and digests left alone.

Every token here is fabricated (random characters in the kind's shape): none is, or was, a real credential."""

from __future__ import annotations

import base64
import json
import random
import re
import string
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest
import structlog
import uvicorn
from httpx import Response
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.errors import ContentPolicyViolation
from gateway.guards import secrets
from gateway.guards.config import GuardsFile
from gateway.guards.guarding import Guards, RequestGuard
from gateway.telemetry import metrics
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.served import running
from tests.unit.test_batches import by_custom_id, chat_line, jsonl, lines_of, submit, wait
from tests.unit.test_batches import settings as batch_settings
from tests.unit.test_guard_evasion import HIDDEN, WAYS_IN
from tests.unit.test_responses import sdk_for

MODEL = "fake-model"
ALNUM = string.ascii_letters + string.digits
_random = random.Random(40)


def fake(size: int, chars: str = ALNUM) -> str:
    return "".join(_random.choice(chars) for _ in range(size))


def b64url(value: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


PEM_BODY = "\n".join(fake(64, ALNUM + "+/") for _ in range(5))
# kind, its placeholder word, the text a client sends, the secret in it (what must not leave)
TOKENS: list[tuple[str, str, str, str]] = [
    ("aws", "AWS_KEY", "key id {}", "AKIA" + fake(16, string.ascii_uppercase + string.digits)),
    ("aws", "AWS_KEY", 'aws_secret_access_key = "{}"', fake(40, ALNUM + "/+")),
    ("aws", "AWS_KEY", "AWS_SECRET_ACCESS_KEY={}\n", fake(40, ALNUM + "/+")),
    ("google", "GOOGLE_KEY", "maps key {} here", "AIza" + fake(35, ALNUM + "-_")),
    ("google", "GOOGLE_KEY", '"client_secret": "{}"', "GOCSPX-" + fake(28, ALNUM + "-_")),
    ("azure", "AZURE_KEY", "DefaultEndpointsProtocol=https;AccountName=acme;{};EndpointSuffix=core.windows.net",
     "AccountKey=" + fake(86, ALNUM + "+/") + "=="),
    ("azure", "AZURE_KEY", "AZURE_CLIENT_SECRET {} ok", fake(3) + "8Q~" + fake(34, ALNUM + "_~.-")),
    ("github", "GITHUB_TOKEN", "git clone https://{}@github.com/acme/app", "ghp_" + fake(36)),
    ("github", "GITHUB_TOKEN", "token {}.", "github_pat_" + fake(22) + "_" + fake(59)),
    ("gitlab", "GITLAB_TOKEN", "PRIVATE-TOKEN: {}", "glpat-" + fake(20, ALNUM + "_-")),
    ("slack", "SLACK_TOKEN", "SLACK_BOT_TOKEN {}", f"xoxb-{fake(11, string.digits)}-{fake(13, string.digits)}-{fake(24, string.ascii_lowercase + string.digits)}"),
    ("slack", "SLACK_TOKEN", "post to {} now",
     f"https://hooks.slack.com/services/T{fake(8, string.ascii_uppercase + string.digits)}/B{fake(10, string.ascii_uppercase + string.digits)}/{fake(24)}"),
    ("stripe", "STRIPE_KEY", "Stripe: {}", "sk_live_" + fake(24)),
    ("stripe", "STRIPE_KEY", "restricted {}", "rk_live_" + fake(99)),  # newer keys run on past detect-secrets' 24
    ("openai", "OPENAI_KEY", "OPENAI_API_KEY {}", "sk-" + fake(20) + "T3BlbkFJ" + fake(20)),
    ("openai", "OPENAI_KEY", "use {} please", "sk-proj-" + fake(74, ALNUM + "_-") + "T3BlbkFJ" + fake(74, ALNUM + "_-")),
    ("anthropic", "ANTHROPIC_KEY", "x-api-key: {}", "sk-ant-api03-" + fake(93, ALNUM + "_-") + "AA"),
    ("private_key", "PRIVATE_KEY", "my key:\n{}\nthanks", f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----"),
    ("private_key", "PRIVATE_KEY", "{}", f"-----BEGIN OPENSSH PRIVATE KEY-----\n{PEM_BODY}\n-----END OPENSSH PRIVATE KEY-----"),
    ("jwt", "JWT", "Authorization: Bearer {}",
     f"{b64url({'alg': 'HS256', 'typ': 'JWT'})}.{b64url({'sub': '42', 'name': 'Jo'})}.{fake(43, ALNUM + '-_')}"),
    ("other", "TOKEN", "SENDGRID {}", f"SG.{fake(22, ALNUM + '_-')}.{fake(43, ALNUM + '_-')}"),
    ("high_entropy", "SECRET", '{{"session": "{}"}}', fake(32)),
    ("high_entropy", "SECRET", "DB_URL_TOKEN={}\n", fake(40, ALNUM + "+/")),
    ("high_entropy", "SECRET", "hashicorp_token: {}", fake(32)),  # a key that only begins like a digest's
    ("keyword", "SECRET", 'password = "{}"', "hunter2-" + fake(4)),
]
IDS = [f"{kind}-{i}" for i, (kind, *_) in enumerate(TOKENS)]
NOT_SECRETS = [
    "Paris is the capital of France; the password policy asks for twelve characters.",
    "Request 550e8400-e29b-41d4-a716-446655440000 failed; retry with id 6ba7b810-9dad-11d1-80b4-00c04fd430c8.",
    '{"id": "550e8400-e29b-41d4-a716-446655440000", "user_id": "a1b2c3d4e5f6a7b8c9d0e1f2"}',
    "The fix is commit 3f786850e387550fdab836ed7e6dc881de23001b, and its sha256 is "
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855.",
    '{"sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "etag": "W/33a64df551425fcc55e4d42a148795d9f25f89d4"}',
    "version=1.2.3 name=example-service region=eu-west-1 replicas=3",
    'api_key = "${API_KEY}"  # read from the environment; token: <your token here>',
    "Set AWS_SECRET_ACCESS_KEY in your environment, then BEGIN the migration.",
    "sk-learn and sk-image are libraries; the xox game; eyJ is how base64 JSON starts.",
    "The abcdefghijklmnopqrstuvwxyz0123456789 alphabet, and ABCDEFGHIJKLMNOPQRSTUVWXYZ.",
    "Internationalization=localization; antidisestablishmentarianism is a long word.",
    "def connect(password):\n    return db.login(user, password)\n",
]


@pytest.fixture(autouse=True)
def _own_guard_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = prometheus_client.Counter("gateway_guard_actions", "test", ["guard", "stage", "action"], registry=None)
    monkeypatch.setattr(metrics, "GUARD_ACTIONS", counter)


def guard(secrets: object) -> RequestGuard:
    file = {"default": "p", "profiles": {"p": {"input": {"secrets": secrets}}}}
    return Guards(GuardsFile.model_validate(file), {}).for_request(None)


# --- each kind, each action ---------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "label", "form", "secret"), TOKENS, ids=IDS)
def test_each_kind_is_redacted_whole_and_restored(kind: str, label: str, form: str, secret: str) -> None:
    text = form.format(secret)
    for checks in ({kind: "redact"}, "redact"):  # its own kind alone, and every kind at once
        redacting = guard(checks)
        checked = redacting.check_input([text], "messages")[0]
        assert secret not in checked
        assert not any(piece in checked for piece in (secret[:12], secret[-12:]))  # no part of it left over
        placeholder = checked[checked.index("[") : checked.index("]") + 1]
        assert secret in redacting.placeholders.restore(placeholder)
        assert redacting.placeholders.restore(checked) == text
    assert f"[{label}_1]" in guard({kind: "redact"}).check_input([text], "messages")[0]


@pytest.mark.parametrize(("kind", "label", "form", "secret"), TOKENS, ids=IDS)
def test_each_kind_blocks_naming_the_kind_never_the_value(kind: str, label: str, form: str, secret: str) -> None:
    blocking = guard({kind: "block"})
    with pytest.raises(ContentPolicyViolation) as refused:
        blocking.check_input(["hello", form.format(secret)], "messages", together=True)
    assert f"guard secrets.{kind}" in refused.value.message
    assert secret[:8] not in refused.value.message
    assert blocking.actions == [f"input:secrets.{kind}:block"]


@pytest.mark.parametrize(("kind", "label", "form", "secret"), TOKENS, ids=IDS)
def test_each_kind_flagged_passes_unchanged_and_is_named(kind: str, label: str, form: str, secret: str) -> None:
    flagging = guard({kind: "flag"})
    assert flagging.check_input([form.format(secret)], "messages") == [form.format(secret)]
    assert f"input:secrets.{kind}:flag" in flagging.actions


@pytest.mark.parametrize("text", NOT_SECRETS)
def test_ordinary_text_ids_and_digests_are_not_secrets(text: str) -> None:
    everything = guard("block")
    assert everything.check_input([text], "messages") == [text]
    assert everything.actions == []


def test_a_disguised_secret_is_found_as_the_model_reads_it() -> None:
    token = "ghp_" + fake(36)
    for disguised in (token[:10] + "\u200b" + token[10:], "".join(chr(ord(c) + 0xFEE0) for c in token),
                      json.dumps({"t": token}).replace("g", "\\u0067")):
        with pytest.raises(ContentPolicyViolation):
            guard({"github": "block"}).check_input([disguised], "messages")


@pytest.mark.parametrize(("kind", "glued"), [
    ("jwt", "eyJ"),  # a prefix that makes detect-secrets' match start early, where it is not a JWT
    ("jwt", "eyJeyJeyJ"),
    ("openai", "sk-\u00e9"),  # a run its pattern cannot cross, before the key
    ("openai", "sk-" * 50),
])
def test_a_secret_glued_to_a_prefix_is_still_found(kind: str, glued: str) -> None:
    secret = next(secret for k, _, _, secret in TOKENS if k == kind)
    redacting = guard({kind: "redact"})
    checked = redacting.check_input([f"see {glued}{secret} ok"], "messages")[0]
    assert secret not in checked
    assert secret[-16:] not in checked


class Counted:
    """A pattern whose `match` calls are counted (the work a keyword pattern does is its tries)."""

    def __init__(self, pattern: re.Pattern[str], tries: list[int]) -> None:
        self.pattern, self.tries = pattern, tries

    def match(self, text: str, *at: int) -> re.Match[str] | None:
        self.tries[0] += 1
        self.read = max(getattr(self, "read", 0), (at[1] if len(at) > 1 else len(text)) - at[0] if at else len(text))
        return self.pattern.match(text, *at)


@pytest.mark.parametrize("run", ["secret_" * 2000, "password" * 2000, "pwd" * 5000 + ' = "hunter2-x9"'])
def test_keywords_glued_in_one_run_are_tried_once_per_run(monkeypatch: pytest.MonkeyPatch, run: str) -> None:
    """Each keyword pattern tried from every keyword of one long word (`secret_secret_...`) went over the rest of the
    word each time: 16 KB took minutes. A pattern that failed from a keyword fails from any later one in its run."""
    tries = [0]
    monkeypatch.setattr(secrets, "KEYWORD_AFTER", [(Counted(p, tries), g) for p, g in secrets.KEYWORD_AFTER])
    monkeypatch.setattr(secrets, "WORD", Counted(secrets.WORD, tries))  # the run's end, read once
    found = [run[start:end] for start, end in secrets.keyword_spans(run)]
    assert tries[0] <= len(secrets.KEYWORD_AFTER) + 1
    assert set(found) == ({"hunter2-x9"} if "hunter2" in run else set())


def test_a_keyword_pattern_reads_a_bounded_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a long line of backticks a keyword's quoted value ran to the line's end from each keyword (36 KB: 14 s)."""
    patterns = [Counted(p, [0]) for p, _ in secrets.KEYWORD_AFTER]
    monkeypatch.setattr(secrets, "KEYWORD_AFTER", [(c, g) for c, (_, g) in zip(patterns, secrets.KEYWORD_AFTER, strict=True)])
    list(secrets.keyword_spans("== " + "password`" * 4000))
    assert max(c.read for c in patterns) <= len("password") + secrets.AFTER_CHARS
    for text in ('x; password = "hunter2-x9"; y', "if 'hunter2-x9' == db_password:", "secret: `hunter2-x9`;"):
        assert {text[start:end] for start, end in secrets.keyword_spans(text)} == {"hunter2-x9"}  # found as before


@pytest.mark.parametrize("cut", [40, 200, 330])
def test_a_private_key_sent_in_two_texts_is_redacted_in_both(cut: int) -> None:
    """A key cut between two messages or content parts: the second part (its body and END line, no BEGIN) went out
    but for the 128 characters the join is read across."""
    pem = next(secret for kind, _, _, secret in TOKENS if kind == "private_key")
    redacting = guard({"private_key": "redact"})
    checked = redacting.check_input(["my key:\n" + pem[:cut], pem[cut:] + "\nthanks"], "messages", together=True)
    assert not any(line in text for line in pem.splitlines() for text in checked), checked
    assert checked[1].endswith("]\nthanks")
    assert redacting.placeholders.restore("".join(checked)) == "my key:\n" + pem + "\nthanks"


def test_secrets_are_checked_only_on_the_way_in() -> None:
    config = GuardsFile.model_validate({"default": "p", "profiles": {"p": {"input": {"secrets": "redact"}}}})
    assert config.profiles["p"].input.secrets.aws == "redact"
    with pytest.raises(ValueError, match="secrets"):  # an output profile has no such check
        GuardsFile.model_validate({"profiles": {"p": {"output": {"secrets": "block"}}}})


# --- every way in, embedded and remote -----------------------------------------------------------

TOKEN = "ghp_" + fake(36)
GUARDS = """
default: p
profiles:
  p:
    input: {{secrets: {{github: {action}, aws: {action}}}}}
"""
FORWARDED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")  # the routes a remote model is served on
SECRET_WAYS = [(route, json.loads(json.dumps(body).replace(json.dumps(HIDDEN)[1:-1], f"my token {TOKEN}")))
               for route, body in WAYS_IN if json.dumps(HIDDEN)[1:-1] in json.dumps(body)]


class Upstream:
    """A remote model's upstream that records what it is sent (the raw bodies) and answers each route briefly."""

    def __init__(self) -> None:
        self.bodies: list[str] = []
        self._server = uvicorn.Server(uvicorn.Config(
            Starlette(routes=[Route("/v1/{path:path}", self._answer, methods=["POST"])]), log_level="warning"))

    async def _answer(self, request: Request) -> JSONResponse:
        self.bodies.append((await request.body()).decode())
        body = json.loads(self.bodies[-1])
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if request.url.path.endswith("/embeddings"):
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            return JSONResponse({"object": "list", "model": "m", "usage": usage, "data": [
                {"object": "embedding", "index": i, "embedding": [1.0, 0.0]} for i in range(len(inputs))]})
        if request.url.path.endswith("/completions") and "chat" not in request.url.path:
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            return JSONResponse({"id": "c", "object": "text_completion", "created": 0, "model": "m", "usage": usage,
                                 "choices": [{"index": i, "text": "ok", "finish_reason": "stop"} for i in range(len(prompts))]})
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "usage": usage,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "finish_reason": "stop"}]})


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    server = Upstream()
    with running(server._server) as port:
        yield server, f"http://127.0.0.1:{port}/v1"


def gateway(tmp_path: Path, engine: FakeEngine, action: str, remote: str | None = None) -> TestClient:
    (tmp_path / "guards.yaml").write_text(GUARDS.format(action=action))
    settings: dict = {"guards_file": tmp_path / "guards.yaml"}
    if remote:
        (tmp_path / "models.yaml").write_text(f"models: [{{name: {MODEL}, kind: remote, url: '{remote}'}}]")
        settings["models_file"] = tmp_path / "models.yaml"
    return TestClient(create_app(fake_settings(**settings), engine_starter=lambda es: engine), raise_server_exceptions=False)


def engine_saw(engine: FakeEngine) -> str:
    """Everything the embedded engine was given, as text."""
    texts = [r.prompt_text or engine.tokenizer.decode(r.prompt_token_ids) for r in engine.requests]
    texts += [engine.tokenizer.decode(ids) for e in engine.embedded for ids in e.inputs]
    return "\n".join(texts)


def sent_through(tmp_path: Path, upstream: tuple[Upstream, str], action: str, route: str, body: dict,
                 where: str) -> tuple[Response, str, list]:
    """The answer to `body` through a gateway whose profile takes `action` on secrets, what the engine or the
    upstream received of it, and the log lines."""
    server, url = upstream
    engine = FakeEngine(task="embed") if route == "/v1/embeddings" else FakeEngine()
    sent = len(server.bodies)
    with gateway(tmp_path, engine, action, url if where == "remote" else None) as client, \
            structlog.testing.capture_logs() as logs:
        answer = client.post(route, json={"model": MODEL, **body})
    received = "\n".join(server.bodies[sent:]) + engine_saw(engine)
    assert TOKEN not in json.dumps(logs, default=str)
    return answer, received, logs


WAYS = pytest.mark.parametrize(("route", "body"), SECRET_WAYS, ids=[f"{r} {i}" for i, (r, _) in enumerate(SECRET_WAYS)])


@WAYS
@pytest.mark.parametrize("where", ["embedded", "remote"])
def test_a_secret_is_refused_on_every_way_in(tmp_path: Path, upstream: tuple[Upstream, str], route: str, body: dict,
                                             where: str) -> None:
    answer, received, _ = sent_through(tmp_path, upstream, "block", route, body, where)
    assert answer.status_code == 400, answer.text
    assert received == ""
    error = answer.json()["error"]
    if where == "remote" and route not in FORWARDED:
        return  # refused as a route a remote model is not served on
    assert "guard secrets.github" in error["message"]
    assert TOKEN not in answer.text
    if route != "/v1/messages":  # Anthropic's error shape has no code
        assert error["code"] == "content_policy_violation"


@WAYS
@pytest.mark.parametrize("where", ["embedded", "remote"])
def test_a_redacted_secret_reaches_neither_engine_nor_upstream(tmp_path: Path, upstream: tuple[Upstream, str],
                                                              route: str, body: dict, where: str) -> None:
    if where == "remote" and route not in FORWARDED:
        pytest.skip("not served for a remote model")
    answer, received, logs = sent_through(tmp_path, upstream, "redact", route, body, where)
    assert answer.status_code == 200, answer.text
    assert TOKEN not in received
    assert TOKEN[4:16] not in received
    assert "[GITHUB_TOKEN_1]" in received or (route == "/v1/embeddings" and where == "embedded")  # fake tokenizer words
    line = next(entry for entry in logs if entry["event"] == "request")
    assert "input:secrets.github:redact" in line["guards"]


def test_a_secret_is_not_logged_even_with_prompts_logged(tmp_path: Path) -> None:
    (tmp_path / "guards.yaml").write_text(GUARDS.format(action="flag"))
    engine = FakeEngine()
    app = create_app(fake_settings(guards_file=tmp_path / "guards.yaml", log_prompts=True), engine_starter=lambda es: engine)
    with TestClient(app) as client, structlog.testing.capture_logs() as logs:
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [{"type": "function", "function": {"name": "f", "description": TOKEN}}]})
    line = next(entry for entry in logs if entry["event"] == "request")
    assert line["guards"] == ["input:secrets.github:flag"]
    assert TOKEN not in json.dumps(line.get("guard_matches"), default=str)


def test_a_batchs_lines_pass_the_secrets_check(tmp_path: Path) -> None:
    """A batch line is a request to its route: a secret in it is refused or redacted as there."""
    (tmp_path / "guards.yaml").write_text(GUARDS.format(action="block").replace("aws: block", "aws: redact"))
    engine = FakeEngine()
    key_id = "AKIA" + fake(16, string.ascii_uppercase + string.digits)
    app = app_with(engine, guards_file=tmp_path / "guards.yaml", **batch_settings(tmp_path))
    with TestClient(app) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, jsonl(chat_line("blocked", f"my token {TOKEN}"),
                                           chat_line("redacted", f"my key id {key_id}"))).id)
        answers = by_custom_id(lines_of(sdk, done.output_file_id) + lines_of(sdk, done.error_file_id))
    assert answers["blocked"]["response"]["status_code"] == 400
    assert "guard secrets.github" in answers["blocked"]["response"]["body"]["error"]["message"]
    assert answers["redacted"]["response"]["status_code"] == 200
    assert [r.prompt_text for r in engine.requests] == ["<user> my key id [AWS_KEY_1] <assistant>"]
