"""Webhook rules, pure: the Standard Webhooks signature (checked with the ``standardwebhooks``
library receivers use), the older signature, the allow-list and the address decision of the
egress guard."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import string
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook, WebhookVerificationError

from broker.config import build_settings
from broker.errors import ConfigError
from broker.webhooks import (
    Allowlist,
    Signer,
    address_kind,
    address_problem,
    callback_problem,
    parse_entry,
    signature,
    signature_valid,
    standard_signature,
    webhook_key,
)
from workers.egress import EgressRefused, permitted

# -- Standard Webhooks -----------------------------------------------------------------------

ids = st.text(alphabet=string.ascii_letters + string.digits + "._:-", min_size=1, max_size=140)
bodies = st.binary(max_size=300).map(lambda b: base64.b64encode(b))  # UTF-8, as ours are


def headers_for(secret: str, webhook_id: str, body: bytes, stamp: int | None = None) -> Any:
    return Signer.from_secret(secret).headers(
        webhook_id=webhook_id,
        message_id=webhook_id.rsplit(".", 1)[0],
        timestamp=int(time.time()) if stamp is None else stamp,
        body=body,
        attempt=3,
    )


def test_the_specification_s_test_vector() -> None:
    key = webhook_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'

    signed = standard_signature(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body)

    assert signed == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@settings(max_examples=60, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), padded=st.booleans(), wid=ids, body=bodies)
def test_the_library_verifies_a_whsec_secret_s_signature(
    key: bytes, padded: bool, wid: str, body: bytes
) -> None:
    encoded = base64.b64encode(key).decode()
    secret = "whsec_" + (encoded if padded else encoded.rstrip("="))

    Webhook(secret).verify(body, headers_for(secret, wid, body), json_parse=False)


@settings(max_examples=60, deadline=None)
@given(
    secret=st.text(min_size=1, max_size=40).filter(lambda s: not s.startswith("whsec_")),
    wid=ids,
    body=bodies,
)
def test_the_library_verifies_a_plain_secret_s_signature_under_its_bytes(
    secret: str, wid: str, body: bytes
) -> None:
    secret = secret.encode("utf-8", "replace").decode()  # a secret from a file or the env

    Webhook(secret.encode()).verify(body, headers_for(secret, wid, body), json_parse=False)


@pytest.mark.parametrize(
    "tamper",
    ["body", "id", "timestamp", "secret"],
)
def test_the_library_refuses_a_tampered_delivery(tamper: str) -> None:
    secret, body = "whsec_" + base64.b64encode(b"k" * 24).decode(), b'{"id":"m1"}'
    headers = headers_for(secret, "m1.1", body)
    verifier = Webhook(secret)
    if tamper == "body":
        body = b'{"id":"m2"}'
    elif tamper == "id":
        headers["webhook-id"] = "m1.2"
    elif tamper == "timestamp":
        headers["webhook-timestamp"] = str(int(headers["webhook-timestamp"]) + 1)
    else:
        verifier = Webhook(b"another key")

    with pytest.raises(WebhookVerificationError):
        verifier.verify(body, headers)


def test_a_stale_delivery_is_refused_by_the_library() -> None:
    headers = headers_for("s3cret", "m1.1", b"{}", stamp=int(time.time()) - 600)

    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(b"s3cret").verify(b"{}", headers)


def test_every_header_of_a_delivery() -> None:
    headers = Signer.from_secret("s3cret").headers(
        webhook_id="m1.2", message_id="m1", timestamp=1700000000, body=b"{}", attempt=4
    )
    mac = hmac.new(b"s3cret", b"m1.2.1700000000.{}", hashlib.sha256).digest()

    assert headers == {
        "Content-Type": "application/json",
        "webhook-id": "m1.2",
        "webhook-timestamp": "1700000000",
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
        "X-Reach-Message-Id": "m1",
        "X-Reach-Timestamp": "1700000000",
        "X-Reach-Signature": signature("s3cret", "1700000000", b"{}"),
        "X-Reach-Delivery-Attempt": "4",
    }


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        ("whsec_not base64!", "must be base64"),
        ("whsec_abcde", "must be base64"),  # 5 characters: no whole byte count
        ("whsec_ab-_", "must be base64"),  # URL-safe letters: the library would skip them
        ("whsec_ñandú", "must be base64"),
        ("whsec_", "must have a key"),
        ("whsec_====", "must have a key"),
    ],
)
def test_a_whsec_secret_that_is_not_base64_is_a_config_error(secret: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        webhook_key(secret)
    with pytest.raises(ConfigError) as info:
        build_settings([{"webhook_secret": secret}])

    assert info.value.key == "webhook_secret"
    assert says in info.value.problem
    key_part = secret.removeprefix("whsec_")
    assert not key_part or key_part not in str(info.value)  # a secret is never shown


@pytest.mark.parametrize("secret", ["s3cret", "whsec_" + base64.b64encode(b"key").decode()])
def test_good_secrets_build(secret: str) -> None:
    assert build_settings([{"webhook_secret": secret}]).webhook_secret == secret


# -- the older X-Reach-Signature -------------------------------------------------------------


def test_the_older_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    body = b'{"id":"m1","stage":"SUCCEEDED","result":1}'
    expected = hmac.new(b"s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()

    assert signature("s3cret", "1700000000", body) == f"sha256={expected}"
    assert signature_valid("s3cret", "1700000000", body, f"sha256={expected}")


@pytest.mark.parametrize(
    ("secret", "timestamp", "body"),
    [
        ("other", "1700000000", b"{}"),
        ("s3cret", "1700000001", b"{}"),
        ("s3cret", "1700000000", b"[]"),
    ],
)
def test_any_change_breaks_the_older_signature(secret: str, timestamp: str, body: bytes) -> None:
    good = signature("s3cret", "1700000000", b"{}")

    assert not signature_valid(secret, timestamp, body, good)


# -- the allow-list and callback URLs --------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "parsed"),
    [
        ("hooks.example.com", "hooks.example.com"),
        (" Hooks.Example.COM ", "hooks.example.com"),
        ("hooks.example.com:8443", ("hooks.example.com", 8443)),
        ("127.0.0.1", (ipaddress.ip_network("127.0.0.1/32"), None)),
        ("127.0.0.1:8080", (ipaddress.ip_network("127.0.0.1/32"), 8080)),
        ("10.0.0.0/8", (ipaddress.ip_network("10.0.0.0/8"), None)),
        ("10.1.2.3/8", (ipaddress.ip_network("10.0.0.0/8"), None)),
        ("::1", (ipaddress.ip_network("::1/128"), None)),
        ("[::1]", (ipaddress.ip_network("::1/128"), None)),
        ("[::1]:8080", (ipaddress.ip_network("::1/128"), 8080)),
        ("fd00::/8", (ipaddress.ip_network("fd00::/8"), None)),
        ("", None),
        ("a host", None),
        ("10.0.0.0/33", None),
        ("hooks.example.com/x", None),
        ("http://hooks.example.com", None),
        ("host:http", None),
        ("host:0", None),
        ("host:65536", None),
        ("host:" + "9" * 5000, None),
        ("[hooks.example.com]:80", None),
        ("[::1", None),
        ("a:b:c", None),
    ],
)
def test_allow_list_entries(entry: str, parsed: object) -> None:
    assert parse_entry(entry) == parsed


def test_unusable_entries_are_kept_to_be_reported() -> None:
    allowlist = Allowlist.parse(["hooks.example.com", "10.0.0.0/33", "host:http"])

    assert allowlist.unusable == ("10.0.0.0/33", "host:http")
    assert allowlist.hosts == {"hooks.example.com"}


def test_an_allowed_host_with_a_secret_is_fine() -> None:
    assert callback_problem("http://127.0.0.1:8080/hook", ["127.0.0.1"], "s") is None
    assert callback_problem("https://Hooks.Example.com/x", ["hooks.example.com"], "s") is None


def test_a_host_with_a_port_allows_that_port_only() -> None:
    hosts = ["127.0.0.1:8080", "hooks.example.com:443", "[::1]:8080"]

    assert callback_problem("http://127.0.0.1:8080/hook", hosts, "s") is None
    assert callback_problem("https://hooks.example.com/x", hosts, "s") is None
    assert callback_problem("http://[::1]:8080/x", hosts, "s") is None
    assert callback_problem("http://127.0.0.1:6379/", hosts, "s") is not None
    assert callback_problem("http://hooks.example.com/x", hosts, "s") is not None  # port 80
    assert callback_problem("http://[::1]:6379/x", hosts, "s") is not None


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        ("http://10.1.2.3/x", ["10.0.0.0/8"]),
        ("http://10.1.2.3:9000/x", ["10.0.0.0/8"]),
        ("http://[fd00::5]/x", ["fd00::/8"]),
        ("http://[::1]:8080/x", ["::1"]),
        ("http://[::ffff:10.0.0.1]/x", ["10.0.0.0/8"]),
    ],
)
def test_ip_and_network_entries_allow_ip_hosts(url: str, hosts: list[str]) -> None:
    assert callback_problem(url, hosts, "s") is None
    assert callback_problem(url, Allowlist.parse(hosts), "s") is None


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        ("http://11.1.2.3/x", ["10.0.0.0/8"]),
        ("http://10.in-addr.example/x", ["10.0.0.0/8"]),  # a network allows addresses, not names
        ("http://127.1/x", ["127.0.0.1"]),  # not an address: a name nobody listed
        ("http://[fd00::5]/x", ["10.0.0.0/8"]),
    ],
)
def test_ip_and_network_entries_allow_nothing_else(url: str, hosts: list[str]) -> None:
    problem = callback_problem(url, hosts, "s")

    assert problem is not None and "is not allowed" in problem


@pytest.mark.parametrize(
    ("url", "hosts", "secret", "says"),
    [
        ("http://evil.example/x", ["127.0.0.1"], "s", "host 'evil.example' is not allowed"),
        ("http://127.0.0.1/x", [], "s", "allowed: none configured"),
        ("ftp://127.0.0.1/x", ["127.0.0.1"], "s", "must be an http:// or https:// URL"),
        ("http:///nohost", ["127.0.0.1"], "s", "must be an http:// or https:// URL"),
        # urlsplit reads around these (the host stays allowed); httpx refuses them all
        ("http://127.0.0.\t1/x", ["127.0.0.1"], "s", "a space or a control character"),
        ("http://127.0.0.1/a\nb", ["127.0.0.1"], "s", "a space or a control character"),
        ("http://127.0.0.1/a\x00b", ["127.0.0.1"], "s", "a space or a control character"),
        ("http://127.0.0.1/a b", ["127.0.0.1"], "s", "a space or a control character"),
        ("http://127.0.0.1:99999/x", ["127.0.0.1"], "s", "not a valid URL"),
        ("http://127.0.0.1/x", ["127.0.0.1"], None, "no webhook_secret"),
    ],
)
def test_refusals_say_why(url: str, hosts: list[str], secret: str | None, says: str) -> None:
    problem = callback_problem(url, hosts, secret)

    assert problem is not None and says in problem


@settings(max_examples=300, deadline=None)
@given(url=st.text(max_size=80), hosts=st.lists(st.text(max_size=30), max_size=5))
def test_any_url_and_allow_list_get_an_answer_never_an_exception(
    url: str, hosts: list[str]
) -> None:
    problem = callback_problem(url, hosts, "s")

    assert problem is None or problem


# -- the address decision of the egress guard ------------------------------------------------


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.3.4.5", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("100.64.0.1", "non-global"),  # carrier-grade NAT
        ("::ffff:127.0.0.1", "loopback"),
        ("2002:7f00:1::", "loopback (IPv4 127.0.0.1 inside IPv6)"),
    ],
)
def test_internal_addresses_and_what_they_are(address: str, kind: str) -> None:
    assert address_kind(ipaddress.ip_address(address)) is not None
    problem = address_problem(address, 443, Allowlist.parse(["hooks.example.com"]))

    assert problem is not None
    assert problem.startswith(f"{address} is a {kind} address")


def test_a_refusal_says_what_would_allow_it() -> None:
    problem = address_problem("127.0.0.1", 80, Allowlist.parse(["localhost"]))

    assert problem == (
        "127.0.0.1 is a loopback address and no callback_hosts entry covers it"
        " (to allow it, add 127.0.0.1 or 127.0.0.0/8 to callback_hosts)"
    )


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700::1111", "8.8.8.8"])
def test_a_public_address_is_allowed_without_an_entry(address: str) -> None:
    assert address_problem(address, 443, Allowlist.parse(["hooks.example.com"])) is None


@pytest.mark.parametrize(
    ("entries", "address", "port", "allowed"),
    [
        (["127.0.0.0/8"], "127.0.0.1", 80, True),
        (["127.0.0.1"], "127.0.0.1", 80, True),
        (["127.0.0.1:8080"], "127.0.0.1", 8080, True),
        (["127.0.0.1:8080"], "127.0.0.1", 6379, False),
        (["127.0.0.2"], "127.0.0.1", 80, False),
        (["10.0.0.0/8"], "::ffff:10.9.9.9", 80, True),
        (["::1"], "::1", 80, True),
        (["::1"], "127.0.0.1", 80, False),
        (["fe80::/10"], "fe80::1%eth0", 80, True),
        (["localhost"], "127.0.0.1", 80, False),  # a name does not cover what it resolves to
    ],
)
def test_ip_and_network_entries_cover_addresses(
    entries: list[str], address: str, port: int, allowed: bool
) -> None:
    assert (address_problem(address, port, Allowlist.parse(entries)) is None) is allowed


def test_what_is_not_an_address_is_refused() -> None:
    problem = address_problem("localhost", 80, Allowlist.parse(["localhost"]))

    assert problem == "'localhost' is not an IP address"


addresses = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))
names = st.lists(st.from_regex(r"[a-z]{1,10}(\.[a-z]{2,5})?", fullmatch=True), max_size=4)
ports = st.integers(min_value=1, max_value=65535)


@given(address=addresses, hosts=names, port=ports)
def test_only_globally_routable_addresses_pass_a_list_of_names(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, hosts: list[str], port: int
) -> None:
    problem = address_problem(str(address), port, Allowlist.parse(hosts))
    internal = address_kind(address) is not None

    assert (problem is not None) is internal
    if problem is not None:
        assert problem.startswith(f"{address} is a ")


@given(address=addresses, data=st.data(), port=ports, hosts=names)
def test_a_network_containing_an_address_allows_it(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
    data: st.DataObject,
    port: int,
    hosts: list[str],
) -> None:
    prefix = data.draw(st.integers(min_value=0, max_value=address.max_prefixlen))
    network = ipaddress.ip_network(f"{address}/{prefix}", strict=False)

    assert address_problem(str(address), port, Allowlist.parse([*hosts, str(network)])) is None


@given(address=st.ip_addresses(v=4), port=ports)
def test_an_ipv4_address_inside_ipv6_is_judged_as_itself(
    address: ipaddress.IPv4Address, port: int
) -> None:
    mapped = f"::ffff:{address}"
    for entries in ([], [f"{address}/32"], ["hooks.example.com"]):
        allowlist = Allowlist.parse(entries)
        alone = address_problem(str(address), port, allowlist) is None

        assert (address_problem(mapped, port, allowlist) is None) is alone


@given(address=addresses, port=ports, other=ports)
def test_an_address_with_a_port_allows_that_port_only(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, other: int
) -> None:
    entry = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
    allowlist = Allowlist.parse([entry])

    assert address_problem(str(address), port, allowlist) is None
    if other != port and address_kind(address) is not None:
        assert address_problem(str(address), other, allowlist) is not None


@given(entries=st.lists(st.text(max_size=40), max_size=8))
def test_any_allow_list_parses(entries: list[str]) -> None:
    allowlist = Allowlist.parse(entries)

    for entry in entries:
        assert (entry in allowlist.unusable) is (parse_entry(entry) is None)
    assert all(host == host.lower() for host in allowlist.hosts)


def test_the_guard_connects_only_to_permitted_addresses() -> None:
    allowlist = Allowlist.parse(["hooks.example.com", "127.0.0.0/8"])

    assert permitted("hooks.example.com", 80, ["10.0.0.5", "127.0.0.1"], allowlist) == ["127.0.0.1"]
    assert permitted("hooks.example.com", 80, ["93.184.216.34"], allowlist) == ["93.184.216.34"]


def test_the_guard_refuses_a_name_with_no_permitted_address_and_says_why() -> None:
    allowlist = Allowlist.parse(["localhost"])

    with pytest.raises(EgressRefused) as info:
        permitted("localhost", 8080, ["::1", "127.0.0.1"], allowlist)

    message = str(info.value)
    assert message.startswith("refused to connect to localhost:8080: ")
    assert "::1 is a loopback address" in message
    assert "127.0.0.1 is a loopback address" in message
    assert info.value.problems and info.value.host == "localhost"
