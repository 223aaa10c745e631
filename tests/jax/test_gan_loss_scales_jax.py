"""A GAN's two LossScaleOptimizers on JAX: each one's loss-scale series and
skipped steps, exact to the step, against an unprofiled twin stepped one
batch at a time (`train_on_batch`, its optimizers' `iterations` and
`dynamic_scale` read after every step); the findings that judge skips and
collapse name the optimizer; the loss judged (MP012) once every optimizer is
followed, a non-finite loss on a skipped step excused as on TensorFlow."""

from __future__ import annotations

import jax
import jax_runs
import keras
import numpy as np
from custom_step_models import CustomStepRegressor, Gan, _stateless_metrics, gan_data

from mpprof import diagnosis
from mpprof.records import schema

BATCH = 4
NAMES = ("d_opt", "g_opt")


def _gan(d_scale=2.0**15, g_growth=2000, **kwargs):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = Gan(**kwargs)
    model.compile(
        g_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3),
                                                  dynamic_growth_steps=g_growth),
        d_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3),
                                                  initial_scale=d_scale))
    return model


def _twin(make, data) -> dict[str, np.ndarray]:
    """Each optimizer's events [step, scale before, scale after, kind] as an
    unprofiled twin shows them: a step that left `iterations` alone was
    skipped (dated at apply calls plus skipped steps before it), one that
    raised the scale grew it."""
    model = make()
    optimizers = {name: getattr(model, name) for name in NAMES}

    def read():
        return {name: (int(np.asarray(o.iterations.value)),
                       float(np.asarray(o.dynamic_scale.value)))
                for name, o in optimizers.items()}

    states = [read()]
    for start in range(0, len(data), BATCH):
        model.train_on_batch(data[start:start + BATCH])
        states.append(read())
    events = {}
    for name in NAMES:
        found, skipped = [], 0
        for before, after in zip(states, states[1:], strict=False):
            (applied, scale), (applied_after, scale_after) = before[name], after[name]
            if applied_after == applied:
                found.append([applied + skipped, scale, scale_after, schema.EVENT_OVERFLOW])
                skipped += 1
            elif scale_after > scale:
                found.append([applied + skipped, scale, scale_after, schema.EVENT_GROWTH])
        events[name] = np.asarray(found, np.float64).reshape(-1, 4)
    return events


def _profiled(tmp_path, make, data, **profiler):
    return jax_runs.fit(tmp_path, make(), data, None, batch_size=BATCH, **profiler)


def _assert_series_as_twin(run, twin, steps):
    series = run.loss_scales
    assert set(series) == set(NAMES)
    for name in NAMES:
        np.testing.assert_array_equal(series[name].events, twin[name])
        assert series[name].steps_run == steps
        assert series[name].skipped_steps == int(
            (twin[name][:, 3] == schema.EVENT_OVERFLOW).sum())


def _found(run, code):
    return [f for f in diagnosis.diagnose(run) if f.code == code]


def test_each_optimizer_series_and_skips_equal_an_unprofiled_twin(tmp_path):
    # d_opt starts 2**25 too high: it halves down, skipping its first steps;
    # g_opt grows its scale every 3 steps, and skips each probe that overflows.
    data = gan_data(4 * 40)

    def make():
        return _gan(d_scale=2.0**40, g_growth=3)

    twin = _twin(make, data)
    assert (twin["d_opt"][:, 3] == schema.EVENT_OVERFLOW).sum() >= 8
    assert (twin["g_opt"][:, 3] == schema.EVENT_GROWTH).any()
    run = _profiled(tmp_path, make, data, numerics_every=7, flush_every_steps=8)
    _assert_series_as_twin(run, twin, 40)
    context = run.context["collectors"]["loss_scale"]
    assert context["state"] == "ok" and context["primary"] == "d_opt"
    assert set(context["series"]) == set(NAMES)
    assert context["series"]["g_opt"]["dynamic_growth_steps"] == 3
    # The step axis is the primary optimizer's: every step, skipped ones included.
    assert run.health["checked_step"] == 40
    # MP002 judges each series and names the one that overflowed.
    found = _found(run, "MP002")
    assert [f.evidence["optimizer"] for f in found] == ["d_opt"]
    assert found[0].step == 0 and "d_opt = " in found[0].fix
    assert found[0].evidence["initial_descent_overflows"] == int(
        (twin["d_opt"][:, 3] == schema.EVENT_OVERFLOW).sum())


def test_healthy_gan_has_no_loss_scale_finding(tmp_path):
    data = gan_data(4 * 12)
    twin = _twin(_gan, data)
    run = _profiled(tmp_path, _gan, data, numerics_every=5)
    _assert_series_as_twin(run, twin, 12)
    assert not len(twin["d_opt"]) and not len(twin["g_opt"])  # nothing skipped
    for code in ("MP001", "MP002", "MP012"):
        assert not _found(run, code), code
    # Every optimizer followed: the loss is watched and judged again.
    assert run.health["loss_watched"] and run.health["nonfinite_loss_steps"] == 0
    assert sorted(run.health["loss_guarded_by"]) == sorted(NAMES)
    assert run.context["collectors"]["loss_health"]["state"] == "ok"


def test_discriminator_collapse_names_it_and_its_skipped_nonfinite_loss_is_excused(tmp_path):
    # The discriminator's hidden layer overflows float16 on every step (real
    # samples: 6 values in [0, 1) times 30000 past 65504): its
    # loss is non-finite, every d_opt step is skipped and its scale halves
    # below 1 (MP001). The generator's loss goes through the same
    # discriminator: g_opt skips too.
    data = gan_data(4 * 20)

    def make():
        return _gan(d_kernel=keras.initializers.Constant(30000.0))

    twin = _twin(make, data)
    run = _profiled(tmp_path, make, data, numerics_every=50)
    _assert_series_as_twin(run, twin, 20)
    assert len(twin["d_opt"]) == 20  # every step skipped
    # MP001 names each optimizer whose scale the twin saw fall below 1, at
    # the step it did.
    named = {f.evidence["optimizer"]: f.step for f in _found(run, "MP001")}
    collapsed = {name: int(events[np.argmax(events[:, 2] < 1), 0])
                 for name, events in twin.items() if (events[:, 2] < 1).any()}
    assert "d_opt" in collapsed and named == collapsed
    # Its non-finite loss came on steps the loss scales skipped: no MP012.
    assert run.health["loss_watched"] and run.health["first_nonfinite_loss_step"] == 0
    assert run.health["nonfinite_loss_steps"] == 20
    assert not _found(run, "MP012")


def test_gan_nonfinite_loss_with_finite_gradients_is_mp012(tmp_path):
    # d_loss reported as +inf on the step where d_opt has applied 5 updates;
    # the gradients stay finite, so no loss scale skips it.
    data = gan_data(4 * 10)

    def make():
        return _gan(nonfinite_d_loss_at=5)

    twin = _twin(make, data)
    assert not len(twin["d_opt"]) and not len(twin["g_opt"])
    run = _profiled(tmp_path, make, data)
    found = _found(run, "MP012")
    assert len(found) == 1 and found[0].step == 5
    assert run.health["nonfinite_loss_steps"] == 1


def test_gan_nonfinite_loss_on_a_step_only_the_generator_skipped_is_excused(tmp_path):
    # The generator's loss is infinite on the step where d_opt applied its
    # 5th update: g_opt skips it (its gradients are non-finite), d_opt, the
    # primary series, does not. The step's loss is checked as the sum of
    # both: any optimizer's skip catches it, so no MP012.
    data = gan_data(4 * 10)

    def make():
        return _gan(nonfinite_g_loss_at=5)

    twin = _twin(make, data)
    assert not len(twin["d_opt"])
    np.testing.assert_array_equal(twin["g_opt"][:, [0, 3]], [[5, schema.EVENT_OVERFLOW]])
    run = _profiled(tmp_path, make, data)
    _assert_series_as_twin(run, twin, 10)
    assert run.health["first_nonfinite_loss_step"] == 5
    assert run.health["nonfinite_loss_steps"] == 1
    assert not _found(run, "MP012")


class NestedApplyRegressor(CustomStepRegressor):
    """Applies its optimizer inside a `lax.cond` (only when the loss is
    finite): the update lives in the cond's own trace."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        (_, (loss, non_trainable)), grads = jax.value_and_grad(self._loss, has_aux=True)(
            trainable, non_trainable, x, y, optimizer_variables)
        trainable, optimizer_variables = jax.lax.cond(
            keras.ops.isfinite(loss),
            lambda: tuple(self.optimizer.stateless_apply(optimizer_variables, grads, trainable)),
            lambda: (list(trainable), list(optimizer_variables)))
        logs, metrics_variables = _stateless_metrics(self, metrics_variables, {"loss": loss})
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def test_an_update_inside_a_cond_is_said_not_followed(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = NestedApplyRegressor()
    model.compile(optimizer="adam")
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 8), dtype=np.float32), rng.random((16, 1), dtype=np.float32)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=BATCH)
    loss_scale = run.context["collectors"]["loss_scale"]
    assert loss_scale["state"] == "absent" and "nested transformation" in loss_scale["reason"]
    assert run.loss_scale is None and not run.loss_scales
    # Its skips unseen, a non-finite loss could not be told from one: not judged.
    assert not run.health["loss_watched"]
    assert "optimizer" in run.context["collectors"]["loss_health"]["reason"]
    assert run.health["checked_step"] == len(x) // BATCH  # the host's count of steps
    # A look-alike applying at the step's top level is followed.
    keras.utils.set_random_seed(0)
    plain = CustomStepRegressor()
    plain.compile(optimizer="adam")
    run = jax_runs.fit(tmp_path / "plain", plain, x, y, batch_size=BATCH)
    assert run.context["collectors"]["loss_scale"]["state"] == "ok"
    assert run.health["loss_watched"] and run.loss_scale.steps_run == len(x) // BATCH
