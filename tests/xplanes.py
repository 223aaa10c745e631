"""Synthetic XProf traces of GPU kernels (XSpace protos), converted by the
real XProf on a machine without a GPU (FACTS.md: XProf needs the plane stat
device_vendor="Nvidia" to apply its Tensor Core heuristic)."""

import os

from tensorflow.tsl.profiler.protobuf import xplane_pb2

# (kernel name, TF op "name:type", duration us, launches, uses Tensor Cores,
# op eligible), as XProf classifies them (FACTS.md): "uses" is a kernel-name
# heuristic that misses cutlass3x_sm90_tensorop kernels; an Einsum op counts
# as eligible only when its kernel uses Tensor Cores.
KERNELS = [
    ("volta_h884gemm_64x64_ldg8_nn", "model/dense/MatMul:MatMul", 120, 3, True, True),
    ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn",
     "model/dense_2/MatMul:MatMul", 30, 2, True, True),
    ("sgemm_128x64_nn", "model/dense_1/MatMul:MatMul", 70, 2, False, True),
    ("cutlass3x_sm90_tensorop_s64x128x16gemm_f16_f16_f32_f16_f16_128x128x64_tnn",
     "model/mha/query/BatchMatMulV2:BatchMatMulV2", 45, 1, False, True),
    ("sgemm_32x32_tn", "model/dense_1/MatMul:MatMul", 5, 4, False, True),
    ("elementwise_add_kernel", "model/dense/BiasAdd:BiasAdd", 9, 3, False, False),
    ("volta_h884gemm_128x64_nn", "model/mha/key/Einsum:Einsum", 11, 2, True, True),
    ("sgemm_64x64_nn", "model/mha/value/Einsum:Einsum", 13, 1, False, False),
]


def write_gpu_xspace(directory, kernel_specs=KERNELS, vendor="Nvidia"):
    """A synthetic XSpace with one GPU plane holding `kernel_specs`' launches."""
    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=1, name="/device:GPU:0")
    stat_ids = {}

    def stat(name):
        if name not in stat_ids:
            stat_ids[name] = len(stat_ids) + 1
            plane.stat_metadata[stat_ids[name]].id = stat_ids[name]
            plane.stat_metadata[stat_ids[name]].name = name
        return stat_ids[name]

    if vendor:
        plane.stats.add(metadata_id=stat("device_vendor")).str_value = vendor
    line = plane.lines.add(id=1, name="Stream #1", timestamp_ns=1_000)
    offset_ps = 0
    for i, (kernel, op, duration_us, launches, _, _) in enumerate(kernel_specs, 1):
        plane.event_metadata[i].id = i
        plane.event_metadata[i].name = kernel
        for _ in range(launches):
            event = line.events.add(
                metadata_id=i, offset_ps=offset_ps, duration_ps=duration_us * 1_000_000
            )
            offset_ps += duration_us * 1_000_000 + 1_000
            event.stats.add(metadata_id=stat("kernel_details")).str_value = (
                "regs:32 static_shmem:0 dynamic_shmem:0 grid:1,1,1 block:128,1,1 "
                "occ_pct:50.0"
            )
            event.stats.add(metadata_id=stat("tf_op")).str_value = op
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "gpuhost.xplane.pb")
    with open(path, "wb") as f:
        f.write(space.SerializeToString())
    return path


def total_us(specs):
    return float(sum(duration * launches for _, _, duration, launches, _, _ in specs))
