"""The search loop: Optuna's ask/tell over one family's space, with candidates compiled in worker processes
while the main process measures the previous ones on the GPU.

Storage is an Optuna RDB URL: a SQLite file by default (a tune stopped by Ctrl-C or a crash resumes with every
finished trial kept), or PostgreSQL so several processes, GPUs or hosts share one study. The measuring and
compiling steps are passed in, so the loop runs (and is tested) without a GPU. Never imports torch.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import optuna

from flash_gen import settings, spec
from flash_gen import tuned as database
from flash_gen.search import space

optuna.logging.set_verbosity(optuna.logging.WARNING)


def default_storage() -> str:
    """SQLite next to the kernel cache."""
    path = Path(settings.cache_dir()) / "tune.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def open_study(name: str, storage: str | None = None, seed: int | None = None) -> optuna.Study:
    """Create or resume study `name`. TPE with the constant liar, so trials running in parallel are spread out."""
    url = storage or default_storage()
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine)
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=8)
    return optuna.create_study(study_name=name, storage=rdb, direction="minimize", load_if_exists=True,
                               sampler=sampler)


@dataclass(frozen=True)
class Rejected:
    """A candidate that never reaches the GPU, with the reason (static model, ptxas spills, compile error)."""

    reason: str


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def measured(study: optuna.Study) -> dict[str, float]:
    """Config name -> milliseconds of every completed trial (repeated suggestions reuse these)."""
    return {t.user_attrs["config"]: t.value for t in finished(study) if "config" in t.user_attrs}


def warm_start(study: optuna.Study, source: optuna.Study, count: int = 4) -> int:
    """Enqueue in `study` the `count` fastest distinct configs of `source`, another bucket of the same family (same
    space, kernels already compiled), so a bucket with a short budget measures likely winners before its sampler
    spends that budget compiling fresh points. Returns how many were enqueued."""
    names: set[str] = set()
    for t in sorted(finished(source), key=lambda t: t.value):
        name = t.user_attrs.get("config")
        if name in names:
            continue
        names.add(name)
        study.enqueue_trial(t.params, skip_if_exists=True)
        if len(names) == count:
            break
    return len(names)


def seed_params(db: database.TunedDb, family: space.Family, bucket: space.Bucket,
                candidates: Sequence = ()) -> list[dict]:
    """The params of the live configs `db` holds for `bucket` of the family's own key (so a re-tune with a short
    budget re-measures, and cannot lose, what an earlier tune found) and of its sibling keys (the other dtype: the
    same kernels but for the element type, so the likeliest winners), then of `candidates` (configs named by
    `flash-gen tune --candidates`, e.g. a bench's find), for the bucket's study to measure first.
    Skips configs of another template or outside the family's axes, infeasible for its key, or its default
    (measured anyway)."""
    axes, default = space.axes(family), space.default_config(family)
    dtypes = sorted(spec.DTYPES, key=lambda d: d != family.dtype)  # own first
    configs = [db.live_config(replace(family, dtype=dtype).key, bucket.name) for dtype in dtypes]
    out = []
    for cfg in (*configs, *candidates):
        if cfg is None or cfg == default or space.infeasible(family, cfg) is not None:
            continue
        params = asdict(cfg)
        if params.keys() == axes.keys() and all(v in axes[k] for k, v in params.items()) and params not in out:
            out.append(params)
    return out


def search(
    study: optuna.Study,
    family: space.Family,
    *,
    prepare: Callable,  # prepare(family, cfg) -> None | Rejected, in a worker process (compile, read ptxas)
    measure: Callable,  # measure(cfg) -> ms per shape of the bucket, or Rejected (wrong results), in this process
    pool: Executor,
    workers: int,
    trials: int,
    deadline: float | None = None,  # time.monotonic() value after which no new trial starts
    on_trial: Callable[[optuna.trial.FrozenTrial | None], None] = lambda t: None,
) -> None:
    """Run trials until the study holds `trials` completed ones or the deadline passes. Infeasible points are
    told PRUNED at once; compiled candidates are measured as their compiles finish, unless the deadline has passed
    by then (told PRUNED too): precompiled candidates are all submitted at once, and measuring every one of them
    used to run a bucket far past its share, leaving the next bucket one trial (2026-12-05). One candidate is
    submitted and measured even past the deadline: a bucket whose share of a time budget the earlier buckets' last
    trials (and its own default's measurement) used up would otherwise record nothing (head dim 224 causal s>4k,
    2026-12-05)."""
    seen = measured(study)
    in_flight: dict[Future, tuple[optuna.trial.Trial, object]] = {}
    submitted = measured_here = 0

    def budget_left() -> bool:
        done = len(finished(study)) + len(in_flight)
        return done < trials and (deadline is None or submitted == 0 or time.monotonic() < deadline)

    while True:
        asked = 0
        while len(in_flight) < workers and budget_left() and asked < 64 * workers:
            asked += 1
            trial = study.ask()
            cfg = space.suggest_config(family, trial.suggest_categorical)
            trial.set_user_attr("config", cfg.name)
            why = space.infeasible(family, cfg)
            if why is not None:
                trial.set_user_attr("rejected", why)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            if cfg.name in seen:  # measured before: the sampler learns without spending the GPU again
                trial.set_user_attr("repeat", True)
                study.tell(trial, seen[cfg.name])
                on_trial(None)
                continue
            in_flight[pool.submit(prepare, family, cfg)] = (trial, cfg)
            submitted += 1
        if not in_flight:
            return
        done, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
        for fut in done:
            trial, cfg = in_flight.pop(fut)
            outcome = fut.result()
            if outcome is None:
                if measured_here and deadline is not None and time.monotonic() >= deadline:
                    trial.set_user_attr("rejected", "not measured: past the time budget")
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    continue
                outcome = measure(cfg)
                measured_here += 1
            if isinstance(outcome, Rejected):
                trial.set_user_attr("rejected", outcome.reason)
                frozen = study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                trial.set_user_attr("shape_ms", outcome)
                outcome = sum(outcome)  # the objective: the bucket's total
                seen[cfg.name] = outcome
                frozen = study.tell(trial, outcome)
            on_trial(frozen)
