"""``WorkerSpec``'s hooks that run without a model instance (issue 19): a validator made
from the spec's kwargs (``request_validator(**kwargs)``), and the batch key
(``batch_keyer``); the one rule of ``omni_async.worker.validation`` holds for both."""

from __future__ import annotations

import pytest

from omni_async.core.errors import InvalidRequest, UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.worker.host import WorkerSpec


def test_request_validator_is_built_from_the_spec_kwargs() -> None:
    small = WorkerSpec("helpers.spec_hooks:SizedWorker", kwargs={"max_size": 2}).request_validator()
    large = WorkerSpec("helpers.spec_hooks:SizedWorker", kwargs={"max_size": 8}).request_validator()
    assert small is not None and large is not None
    large(DiffusionRequest("r", {"size": 5}))
    with pytest.raises(InvalidRequest, match=r"request 'r': parameter 'size' must be an int in 1\.\.2, got 5") as err:
        small(DiffusionRequest("r", {"size": 5}))
    assert err.value.request_id == "r" and err.value.parameter == "size"


def test_a_plain_validate_request_still_works() -> None:
    validator = WorkerSpec("helpers.mp_workers:ClassValidated").request_validator()
    assert validator is not None
    with pytest.raises(InvalidRequest):
        validator(DiffusionRequest("neg", {"size": -1}))
    assert WorkerSpec("helpers.mp_workers:ScriptedWorker").request_validator() is None
    assert WorkerSpec("helpers.spec_hooks:SizedWorker", check_import=False).request_validator() is None


def test_batch_keyer_is_the_factorys_static_batch_key() -> None:
    keyer = WorkerSpec("helpers.spec_hooks:SizedWorker").batch_keyer()
    assert keyer is not None
    assert keyer(DiffusionRequest("a", {"size": 2})) == keyer(DiffusionRequest("b", {"size": 2})) == ("size", 2)
    assert keyer(DiffusionRequest("c", {})) is None
    assert WorkerSpec("helpers.mp_workers:ScriptedWorker").batch_keyer() is None
    assert WorkerSpec("helpers.spec_hooks:SizedWorker", check_import=False).batch_keyer() is None


@pytest.mark.parametrize(
    ("factory", "hook"),
    [("helpers.spec_hooks:InstanceKeyed", "batch_key"), ("helpers.spec_hooks:InstanceConfigured", "request_validator")],
)
def test_instance_method_hooks_are_refused_at_construction(factory: str, hook: str) -> None:
    with pytest.raises(UsageError, match=rf"\.{hook} is an instance method.*@staticmethod"):
        WorkerSpec(factory)


def test_a_request_validator_that_returns_no_callable_is_refused() -> None:
    spec = WorkerSpec("helpers.spec_hooks:BadValidatorFactory")
    with pytest.raises(UsageError, match=r"request_validator\(\*\*kwargs\) must return a callable.*got int"):
        spec.request_validator()
