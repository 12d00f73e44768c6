"""The Tinker server's checkpoints (reinforge/tinker/checkpoints.py) with a real torch training backend on the demo
model: a saved state resumes to the very next step of the uninterrupted run (with its optimizer, or without it as a
fresh one), sampler weights sample exactly as the live weights did, `reinforge convert` exports a state, writes are
atomic, and a bad path is a one-line error."""

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reinforge.generation.base import GenerationConfig
from reinforge.model_config import LoraConfig
from reinforge.modeling import load_tokenizer
from reinforge.tinker.checkpoints import Checkpoints, TrainedModel
from reinforge.tinker.engine_slot import LiveWeights
from reinforge.tinker.errors import TinkerRequestError
from reinforge.tinker.sampler import SampleParams, Samplers
from reinforge.training.convert import convert
from tests.unit.test_tinker_sampler import BASE, DEMO, Trainer, make_backend, one_step, prompts

LORA = DEMO.model_copy(update={"lora": LoraConfig(rank=4, alpha=8)})


def weights(backend) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in backend.named_weights()}


def assert_equal_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("model", [DEMO, LORA], ids=["full", "lora"])
def test_a_loaded_state_takes_the_same_next_step_as_the_uninterrupted_trainer(tmp_path, model):
    checkpoints = Checkpoints(tmp_path)
    trainer = Trainer(make_backend(model))
    one_step(trainer)
    trained = TrainedModel(BASE, model)
    path = checkpoints.save_state("m1", "step-1", trainer.backend, trained, step=1)
    assert path == "tinker://m1/weights/step-1"
    saved = {name: tensor.detach().clone() for name, tensor in trainer.backend.model.state_dict().items()}
    one_step(trainer)  # the uninterrupted run's second step
    resumed = Trainer(make_backend(model))
    info = checkpoints.load_state(path, resumed.backend, with_optimizer=True, expected=trained)
    assert (info.step, info.trained.lora_rank) == (1, model.lora and 4)
    one_step(resumed)
    assert_equal_weights(weights(resumed.backend), weights(trainer.backend))
    # without the optimizer: the step of a fresh AdamW from the saved weights, not the resumed one's
    fresh = Trainer(make_backend(model))
    checkpoints.load_state(path, fresh.backend, with_optimizer=False)
    reference = Trainer(make_backend(model))
    reference.backend.model.load_state_dict(saved)
    one_step(fresh)
    one_step(reference)
    assert_equal_weights(weights(fresh.backend), weights(reference.backend))
    with pytest.raises(AssertionError):
        assert_equal_weights(weights(fresh.backend), weights(trainer.backend))


@pytest.mark.parametrize("model", [DEMO, LORA], ids=["full", "lora"])
def test_sampler_weights_sample_as_the_live_weights_did(tmp_path, model):
    checkpoints = Checkpoints(tmp_path / "server")
    tokenizer = load_tokenizer(DEMO)
    samplers = Samplers({BASE: DEMO}, GenerationConfig(), lambda name: tokenizer, tmp_path / "server")
    trainer = Trainer(make_backend(model))
    one_step(trainer)
    params = SampleParams(max_tokens=16, seed=11)
    rank = model.lora and model.lora.rank
    live = samplers.sample(LiveWeights(BASE, trainer, trainer.version, rank), prompts(), 4, params)
    path = checkpoints.save_for_sampler("m1", "final", trainer.backend, TrainedModel(BASE, model), step=1)
    assert path == "tinker://m1/sampler_weights/final"
    info = checkpoints.info(path)
    assert (info.directory / ("adapter_config.json" if rank else "config.json")).is_file()
    saved = samplers.sample(info.sampler_weights(), prompts(), 4, params)
    for a, b in zip(live, saved):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            assert x.logprobs == pytest.approx(y.logprobs, abs=0 if rank is None else 1e-5)
    samplers.shutdown()


def test_saved_weights_remembered_as_live_ones_are_served_without_a_refit_until_training_moves_on(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    tokenizer = load_tokenizer(DEMO)
    samplers = Samplers({BASE: DEMO}, GenerationConfig(), lambda name: tokenizer, tmp_path)
    trainer = Trainer(make_backend())
    one_step(trainer)
    live, params = LiveWeights(BASE, trainer, trainer.version, None), SampleParams(max_tokens=12, seed=2)
    first = samplers.sample(live, prompts(), 2, params)
    saved = checkpoints.info(checkpoints.save_for_sampler("m1", "s", trainer.backend, TrainedModel(BASE, DEMO), 1))
    samplers.remember(saved.sampler_weights(), live)
    slot = samplers.slots[BASE]
    refits = slot.refits
    assert samplers.sample(saved.sampler_weights(), prompts(), 2, params) == first
    assert slot.refits == refits  # the engine held them
    one_step(trainer)
    samplers.sample(LiveWeights(BASE, trainer, trainer.version, None), prompts(), 2, params)
    assert samplers.sample(saved.sampler_weights(), prompts(), 2, params) == first  # read back from the directory
    assert slot.refits == refits + 2
    samplers.shutdown()


def test_convert_exports_a_state_as_hugging_face_weights_or_a_peft_adapter(tmp_path):
    checkpoints = Checkpoints(tmp_path / "server")
    for model, name in ((DEMO, "full"), (LORA, "lora")):
        trainer = Trainer(make_backend(model))
        one_step(trainer)
        checkpoints.save_state("m1", name, trainer.backend, TrainedModel(BASE, model), step=1)
        directory = checkpoints.info(f"tinker://m1/weights/{name}").directory
        out = convert(directory, tmp_path / f"hf-{name}", merge=model.lora is not None)
        exported = load_file(str(out / "model.safetensors"))
        expected = weights(trainer.backend)
        for key, tensor in exported.items():
            torch.testing.assert_close(tensor, expected[key], atol=1e-6, rtol=0, msg=key)
    convert(checkpoints.info("tinker://m1/weights/lora").directory, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


class FailingBackend:
    """A backend whose save dies halfway, after writing part of its state."""

    def save_state(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "part").write_text("half")
        raise RuntimeError("disk full")


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    trainer = Trainer(make_backend())
    trained = TrainedModel(BASE, DEMO)
    checkpoints.save_state("m1", "a", trainer.backend, trained, step=3)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoints.save_state("m1", "a", FailingBackend(), trained, step=4, overwrite=True)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoints.save_state("m1", "b", FailingBackend(), trained, step=4)
    assert [c.tinker_path for c in checkpoints.list("m1")] == ["tinker://m1/weights/a"]
    assert checkpoints.load_state("tinker://m1/weights/a", make_backend(), with_optimizer=True).step == 3
    assert sorted(p.name for p in (tmp_path / "m1" / "weights").iterdir()) == ["a"]


def test_info_and_listing_say_what_the_sdk_expects(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    trainer = Trainer(make_backend(LORA))
    lora = TrainedModel(BASE, LORA, train_unembed=False, train_mlp=True, train_attn=True)
    state = checkpoints.save_state("m1", "s", trainer.backend, lora, step=2, user_metadata={"k": "v"})
    sampler = checkpoints.save_for_sampler("m1", None, trainer.backend, lora, step=2, ttl_seconds=3600)
    info = checkpoints.info(state).weights_info()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed) == (BASE, True, 4, False)
    listed = checkpoints.list("m1")
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", state), ("sampler", sampler)]
    assert listed[0].checkpoint_id == "weights/s" and listed[0].user_metadata == {"k": "v"}
    assert listed[0].size_bytes > 0 and listed[0].expires_at is None
    assert listed[1].expires_at > datetime.now(timezone.utc) + timedelta(minutes=59)
    assert checkpoints.list("m2") == [] and len(checkpoints.list()) == 2
    checkpoints.delete(sampler)
    assert [c.tinker_path for c in checkpoints.list()] == [state]


@pytest.mark.parametrize(
    "path, message",
    [
        ("m1/weights/s", "malformed checkpoint path"),
        ("tinker://m1/weights", "malformed checkpoint path"),
        ("tinker://m1/checkpoints/s", "malformed checkpoint path"),
        ("tinker://m1/weights/../../etc", "malformed checkpoint path"),
        ("tinker://m1/weights/nope", "no checkpoint tinker://m1/weights/nope on this server"),
        ("tinker://m2/weights/s", "no checkpoint"),
        ("tinker://m1/sampler_weights/w", "holds sampler weights"),
    ],
)
def test_a_bad_path_is_a_one_line_error(tmp_path, path, message):
    checkpoints = Checkpoints(tmp_path)
    backend = make_backend()
    checkpoints.save_state("m1", "s", backend, TrainedModel(BASE, DEMO), step=0)
    checkpoints.save_for_sampler("m1", "w", backend, TrainedModel(BASE, DEMO), step=0)
    with pytest.raises(TinkerRequestError, match=message) as error:
        checkpoints.load_state(path, backend, with_optimizer=True)
    assert "\n" not in str(error.value)


def test_names_taken_models_that_differ_and_states_sampled_are_refused(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    backend = make_backend()
    state = checkpoints.save_state("m1", "s", backend, TrainedModel(BASE, DEMO), step=0)
    with pytest.raises(TinkerRequestError, match="exists already"):
        checkpoints.save_state("m1", "s", backend, TrainedModel(BASE, DEMO), step=1)
    with pytest.raises(TinkerRequestError, match="holds full weights on demo, and this training client is a LoRA"):
        checkpoints.load_state(state, backend, with_optimizer=True, expected=TrainedModel(BASE, LORA))
    with pytest.raises(TinkerRequestError, match="is a training state"):
        checkpoints.info(state).sampler_weights()
    with pytest.raises(TinkerRequestError, match="malformed checkpoint path"):
        checkpoints.save_state("m1", "a/b", backend, TrainedModel(BASE, DEMO), step=1)
