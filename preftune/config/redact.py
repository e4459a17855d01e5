"""What looks like a credential, and the config as it may be written down (config.yaml, every
checkpoint's and final/'s preftune.yaml, tracker parameters, the ConfigMap): credentials redacted.

A value is redacted when its key names a credential (token, secret, password, api key, access key,
private key, credential, auth) or when it holds one itself (a URL's user:password, an AWS access key
id). A secret given by reference (`{secret: NAME, key: KEY}` in deploy.env) names no credential and
stays. Redaction is idempotent, so a redacted copy compares equal to a redacted original.
"""
from __future__ import annotations

import re

REDACTED = "<redacted>"
SECRET_NAME = re.compile(
    r"(secret|token|passw(or)?d|pwd|api[-_]?key|access[-_]?key|private[-_]?key|credential|"
    r"auth|session[-_]?key)",
    re.I,
)
URL_USERINFO = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@", re.I
)
AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")


def is_reference(value) -> bool:
    """A secret by reference: {secret: NAME, key: KEY} (rendered as a secretKeyRef)."""
    return isinstance(value, dict) and set(value) == {"secret", "key"}


def redact_value(name: str, value):
    if is_reference(value) or value is None or value == "" or isinstance(value, bool):
        return value
    if SECRET_NAME.search(str(name)) and not isinstance(value, (dict, list)):
        return REDACTED
    if isinstance(value, str):
        value = URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value)
        return AWS_KEY_ID.sub(REDACTED, value)
    if isinstance(value, dict):
        return {k: redact_value(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_value(name, v) for v in value]
    return value


def redact(config: dict) -> dict:
    """A copy of a (nested) config dict with every credential replaced by <redacted>."""
    return {k: redact_value(k, v) for k, v in config.items()}


def credentials(config: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values are, or hold, credentials (references excluded)."""
    out = []
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not is_reference(v):
            out += credentials(v, f"{key}.")
        elif redact_value(k, v) != v:
            out.append(key)
    return out
