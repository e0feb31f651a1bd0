"""``python -m mgpu advise``: why two devices are not twice as fast. Measures, on this
machine, each layer's forward and backward time against the per-device batch (from the timeline of
a one-device step), the all-reduce time against size (latency + bytes / bandwidth), the host's
per-step overhead and the input pipeline; then predicts step time, epoch time and speed-up for 1..N
devices and several batch sizes, and names the part that bounds each case. A described machine
(JSON) is predicted from the same measurements, scaled by its FLOP rate and links: not measured.

The parts: ``model`` (predictions from a measurement table), ``steps`` (one step's timeline,
parsed per layer), ``measure`` (this machine's measurements, also under mpirun), ``command``
(the command itself).
"""
from .command import (
    format_table,
    load_machine,
    main,
    median_prediction,
    median_table,
    plot_speedup,
    validate,
)
from .measure import (
    CALIBRATION_GROUPS,
    MAX_CONTENTION_SHARD,
    MAX_MEASURED_SHARD,
    calibration_batch,
    calibration_shard,
    calibration_shards,
    contention_shards,
    measure,
    measure_allreduce,
    measure_effective_cores,
    measure_input,
    measure_mpi,
    measure_mpi_allreduce,
    measure_rank_calibration,
    measure_step,
    mpi_worker,
    mpirun_command,
    needed_shards,
    seconds_per_step,
    slowest_device,
    small_batches,
)
from .model import (
    EXAMPLE_MACHINES,
    MACHINE_KEYS,
    allreduce_time,
    concurrency,
    concurrent_idle,
    core_share,
    crossover,
    device_idle,
    entry_time,
    fit_allreduce,
    fit_line,
    held_interpolate,
    interpolate,
    oversubscription,
    predict,
    predict_table,
)
from .steps import (
    MAX_TRACED_STEPS,
    MIN_TRACED_SECONDS,
    feed,
    parse_step_trace,
    random_batch,
    runner,
    trace_steps,
    traced_steps,
    tracks,
    train_split,
    warm_up,
)

__all__ = ["EXAMPLE_MACHINES", "MACHINE_KEYS", "allreduce_time", "concurrency", "concurrent_idle",
           "core_share", "crossover", "device_idle", "entry_time", "fit_allreduce",
           "fit_line", "held_interpolate", "interpolate", "oversubscription", "predict",
           "predict_table", "MAX_TRACED_STEPS", "MIN_TRACED_SECONDS", "feed",
           "parse_step_trace", "random_batch", "runner", "trace_steps", "traced_steps",
           "tracks", "train_split", "warm_up", "CALIBRATION_GROUPS",
           "MAX_CONTENTION_SHARD", "MAX_MEASURED_SHARD", "calibration_batch",
           "calibration_shard", "calibration_shards", "contention_shards", "measure",
           "measure_allreduce", "measure_effective_cores", "measure_input",
           "measure_mpi", "measure_mpi_allreduce", "measure_rank_calibration",
           "measure_step", "mpi_worker", "mpirun_command", "needed_shards", "seconds_per_step",
           "slowest_device", "small_batches", "format_table", "load_machine", "main",
           "median_prediction", "median_table", "plot_speedup", "validate"]
