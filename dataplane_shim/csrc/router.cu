// ElasticMoE shim router kernel: logical top-k ids -> physical slots, least loaded, ties to the nearest.
//
// Same policy as dataplane_shim/router.py (and its numpy reference): the i-th token of expert e in the
// step (row-major over topk_ids [T, K]) goes to pref[e][(counts[e] + i) % logcnt[e]], where pref[e] lists
// e's slots by (tier from the sending rank, slot id). Deterministic: no atomics decide an order.
//
// One block per logical expert scans the ids and ranks its own hits with a warp ballot + block prefix.
// Work is E x N reads (256 x 32768 int64 = 64 MiB from L2 for DeepSeek-V3 decode batches: tens of us on
// an H200); a sort-based variant (CUB radix sort on 16-bit ids) is the next step for much larger N.
//
// Launch: grid = E, block = 256 (a multiple of 32, at most 1024). Ids must be in [0, E): the host checks.
#include <cstdint>

extern "C" __global__ void emoe_route(
    const int64_t* __restrict__ ids,     // [N] logical expert ids (flattened [T, K])
    int64_t n,
    const int64_t* __restrict__ pref,    // [E, W] this layer's slots of each expert, nearest first, -1 padded
    const int64_t* __restrict__ logcnt,  // [E] replicas of each expert (>= 1 for every id that occurs)
    int64_t* __restrict__ counts,        // [E] tokens of each expert routed so far this step; advanced
    int64_t* __restrict__ out,           // [N] slot of each token
    int E, int W)
{
    const int e = blockIdx.x;
    if (e >= E) return;
    __shared__ int64_t warp_hits[32];
    __shared__ int64_t running;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    if (threadIdx.x == 0) running = counts[e];
    __syncthreads();
    const int64_t c = logcnt[e];
    for (int64_t base = 0; base < n; base += blockDim.x) {
        const int64_t i = base + threadIdx.x;
        const bool hit = i < n && ids[i] == e;
        const unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_hits[warp] = __popc(mask);
        __syncthreads();
        if (hit) {
            int64_t nth = running + __popc(mask & ((1u << lane) - 1u));
            for (int w = 0; w < warp; ++w) nth += warp_hits[w];
            out[i] = pref[(int64_t)e * W + nth % c];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int64_t total = 0;
            for (int w = 0; w < warps; ++w) total += warp_hits[w];
            running += total;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[e] = running;
}
