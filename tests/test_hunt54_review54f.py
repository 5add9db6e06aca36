"""Hunt 54 (review54f): a hostile review of store54's object-store saves (If-None-Match creates, listing checks),
against the session's SeaweedFS server (tests/test_storage_s3.py's ``weed`` fixture; skips without ``weed``)."""

from __future__ import annotations

import uuid

import pytest
import torch

import trainguard as tg
from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _old_botocore(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A client whose botocore predates conditional writes (botocore < 1.35: s3fs 2023.x-2024.6, which the project
    allows): its parameter validation refuses ``IfNoneMatch`` before any request is sent, as those versions do."""
    from botocore import validate
    from botocore.exceptions import ParamValidationError

    refused: list[str] = []
    real = validate.ParamValidator.validate

    def validate_old(self, params, shape):  # noqa: ANN001
        if isinstance(params, dict) and "IfNoneMatch" in params:
            refused.append(shape.name)
            raise ParamValidationError(report='Unknown parameter in input: "IfNoneMatch", must be one of: Bucket, Key')
        return real(self, params, shape)

    monkeypatch.setattr(validate.ParamValidator, "validate", validate_old)
    return refused


@pytest.mark.parametrize("size", [1 << 10, 40 << 20], ids=["put", "multipart"])
def test_a_save_with_a_botocore_that_predates_conditional_writes_succeeds(weed, monkeypatch, size):  # noqa: F811
    """Every object of a save is created with ``If-None-Match: *``. A botocore older than 1.35 (allowed:
    ``s3fs>=2023.1``) does not know the parameter and raises ``ParamValidationError`` (not an ``OSError``) before
    sending anything. Before: every save to S3 failed with it (``Parameter validation failed: Unknown parameter in
    input: "IfNoneMatch"``). Now the object is written as before, unconditionally (the store is treated as one that
    answers 501 to the header), and the save commits and verifies."""
    refused = _old_botocore(monkeypatch)
    url = _url() + "/ckpt"
    w = torch.arange(size // 4, dtype=torch.float32)
    tg.save(url, {"w": w})
    assert refused, "the old client's validation was not reached"
    assert tg.verify(url).ok
    dest = {"w": torch.zeros_like(w)}
    tg.load(url, dest)
    assert torch.equal(dest["w"], w)
