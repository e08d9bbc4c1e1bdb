// Dispatch kernels of moebalance: route, stable counting sort by slot, row gather, weighted combine.
//
// Plain CUDA C++ with extern "C" entry points and no torch or CUDA-library headers, so the file
// compiles with NVRTC at run time (loaded by moebalance/dispatch/cuda.py through CuPy) and with
// nvcc alike. 16-bit floats are handled as raw bits with explicit round-to-nearest-even
// conversions, which keeps the source free of cuda_fp16.h / cuda_bf16.h include paths and gives
// the same rounding as torch's .to(bfloat16/float16).
//
// Every kernel reproduces moebalance/dispatch/reference.py. Arithmetic runs in float for
// float/bfloat16/half data and in double for double data, through mul_rn / add_rn: each product
// and sum rounds on its own (w * y + acc rounds twice, as the reference does, never fused into an
// fma) and float subnormals are kept, whatever -ftz / --fmad options the compiler gets (CuPy
// appends -ftz=true after the caller's options and NVRTC takes the last one).
//
// Legend: T tokens, K top-k, D hidden size, E experts, X most replicas, S slots, N = T*K pairs,
// M rows of a gathered source, C chunks of the counting sort (one warp each).

typedef long long i64;

struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

// -- conversions ---------------------------------------------------------------------------------

__device__ __forceinline__ float to_compute(float v) { return v; }
__device__ __forceinline__ double to_compute(double v) { return v; }
__device__ __forceinline__ float to_compute(bf16_t v) {
    return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}
__device__ __forceinline__ float to_compute(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_compute(float v);
template <> __device__ __forceinline__ float from_compute<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16_t from_compute<bf16_t>(float v) {
    unsigned int u = __float_as_uint(v);
    bf16_t out;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        out.bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);                                  // round to nearest even
        out.bits = static_cast<unsigned short>(u >> 16);
    }
    return out;
}
template <> __device__ __forceinline__ f16_t from_compute<f16_t>(float v) {
    f16_t out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
    return out;
}

// Explicitly rounded float ops in inline PTX: the compiler neither adds .ftz to them nor
// contracts them into an fma (the double intrinsics are not affected by -ftz and never fused).
__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename T> struct Compute { typedef float type; };
template <> struct Compute<double> { typedef double type; };

template <typename T> __device__ __forceinline__ T store(typename Compute<T>::type v) {
    return from_compute<T>(v);
}
template <> __device__ __forceinline__ double store<double>(double v) { return v; }

// V elements moved as one aligned load/store (V * sizeof(T) == 16 on the vector paths).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ i64 global_warp() { return (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ i64 warps_in_grid() { return (static_cast<i64>(gridDim.x) * blockDim.x) >> 5; }

// -- route ----------------------------------------------------------------------------------------

// slot_N[p] = slots_EX[e, j] for the first j with rank_N[p] < bounds_EX[e, j] (the last column
// when there is none): rank_N[p] is the pair's place among this rank's pairs of expert e, and
// bounds_EX the cumulative pairs this rank sends to e's replicas. Out-of-range expert ids get
// slot -1 (checking them on the host would need a sync).
extern "C" __global__ void route_pairs(const i64* __restrict__ ids_N, const i64* __restrict__ rank_N,
                                       const i64* __restrict__ slots_EX,
                                       const i64* __restrict__ bounds_EX, i64 n, i64 num_experts,
                                       i64 num_replicas, i64* __restrict__ slot_N) {
    const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 p = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; p < n; p += stride) {
        const i64 e = ids_N[p];
        if (e < 0 || e >= num_experts) {
            slot_N[p] = -1;
            continue;
        }
        const i64 r = rank_N[p];
        const i64* bound = bounds_EX + e * num_replicas;
        i64 j = 0;
        while (j < num_replicas - 1 && r >= bound[j]) ++j;
        slot_N[p] = slots_EX[e * num_replicas + j];
    }
}

// -- stable counting sort by slot -------------------------------------------------------------------
//
// Pairs are cut into C chunks of `chunk` pairs; warp c owns chunk c and column c of the [S, C]
// tables, so no atomics are needed and every result is deterministic:
//   1. slot_chunk_histogram: hist_SC[s, c] = pairs of chunk c in slot s.
//   2. (host side, torch.cumsum on the same stream) exclusive scan of hist_SC in row-major order:
//      start of (slot s, chunk c) = pairs in slots < s + pairs of slot s in chunks < c.
//   3. slot_chunk_scatter: each warp walks its chunk 32 pairs at a time in pair order; pairs of
//      one slot within those 32 take consecutive positions by lane (a stable rank from
//      __match_any_sync), then the slot's cursor advances by their number.
// Slots outside [0, S) are skipped (their pairs get no position).

extern "C" __global__ void slot_chunk_histogram(const i64* __restrict__ slot_N, i64 n, i64 num_slots,
                                                i64 chunk, i64 num_chunks, i64* __restrict__ hist_SC) {
    const i64 c = global_warp();
    if (c >= num_chunks) return;  // uniform across the warp
    const int lane = lane_id();
    const i64 end = min(n, (c + 1) * chunk);
    for (i64 base = c * chunk; base < end; base += 32) {
        const i64 i = base + lane;
        const i64 s = i < end ? slot_N[i] : -1;
        const unsigned int peers = __match_any_sync(0xffffffffu, s);
        if (s >= 0 && s < num_slots && lane == __ffs(peers) - 1) hist_SC[s * num_chunks + c] += __popc(peers);
        __syncwarp();
    }
}

extern "C" __global__ void slot_chunk_scatter(const i64* __restrict__ slot_N, i64 n, i64 num_slots,
                                              i64 chunk, i64 num_chunks, i64* __restrict__ cursor_SC,
                                              i64* __restrict__ order_N, i64* __restrict__ pos_N) {
    const i64 c = global_warp();
    if (c >= num_chunks) return;
    const int lane = lane_id();
    const unsigned int lower_lanes = (1u << lane) - 1u;
    const i64 end = min(n, (c + 1) * chunk);
    for (i64 base = c * chunk; base < end; base += 32) {
        const i64 i = base + lane;
        const i64 s = i < end ? slot_N[i] : -1;
        const unsigned int peers = __match_any_sync(0xffffffffu, s);
        const bool valid = s >= 0 && s < num_slots;
        i64 q = 0;
        if (valid) {
            q = cursor_SC[s * num_chunks + c] + __popc(peers & lower_lanes);
            pos_N[i] = q;
            order_N[q] = i;
        } else if (i < end) {
            pos_N[i] = -1;  // a dropped pair (slot -1) has no position: combine skips it
        }
        __syncwarp();  // every peer has read the cursor before its leader moves it
        if (valid && lane == __ffs(peers) - 1) cursor_SC[s * num_chunks + c] += __popc(peers);
        __syncwarp();
    }
}

// -- gather rows ------------------------------------------------------------------------------------

// out[i] = x[index[i]] as raw words of type W (16, 8, 4 or 2 bytes); one warp per row.
// Rows whose index is outside [0, M) are left unwritten.
template <typename W>
__device__ __forceinline__ void gather_words(const W* __restrict__ x, const i64* __restrict__ index,
                                             W* __restrict__ out, i64 n, i64 words, i64 num_rows) {
    const int lane = lane_id();
    for (i64 row = global_warp(); row < n; row += warps_in_grid()) {
        const i64 src = index[row];
        if (src < 0 || src >= num_rows) continue;
        const W* s = x + src * words;
        W* d = out + row * words;
#pragma unroll 4
        for (i64 w = lane; w < words; w += 32) d[w] = s[w];
    }
}

struct Word2 { unsigned short v; };
struct alignas(8) Word8 { unsigned int a, b; };
struct alignas(16) Word16 { unsigned int a, b, c, d; };

extern "C" __global__ void gather_rows_w16(const Word16* x, const i64* index, Word16* out, i64 n, i64 words, i64 num_rows) {
    gather_words(x, index, out, n, words, num_rows);
}
extern "C" __global__ void gather_rows_w8(const Word8* x, const i64* index, Word8* out, i64 n, i64 words, i64 num_rows) {
    gather_words(x, index, out, n, words, num_rows);
}
extern "C" __global__ void gather_rows_w4(const unsigned int* x, const i64* index, unsigned int* out, i64 n, i64 words, i64 num_rows) {
    gather_words(x, index, out, n, words, num_rows);
}
extern "C" __global__ void gather_rows_w2(const Word2* x, const i64* index, Word2* out, i64 n, i64 words, i64 num_rows) {
    gather_words(x, index, out, n, words, num_rows);
}

// out[i] = x[index[i]] * scale[i], computed in the compute type; V elements per access.
template <typename T, int V>
__device__ __forceinline__ void gather_scaled(const T* __restrict__ x, const i64* __restrict__ index,
                                              const typename Compute<T>::type* __restrict__ scale,
                                              T* __restrict__ out, i64 n, i64 dim, i64 num_rows) {
    typedef Pack<T, V> P;
    const int lane = lane_id();
    const i64 packs = dim / V;
    for (i64 row = global_warp(); row < n; row += warps_in_grid()) {
        const i64 src = index[row];
        if (src < 0 || src >= num_rows) continue;
        const typename Compute<T>::type a = scale[row];
        const P* s = reinterpret_cast<const P*>(x + src * dim);
        P* d = reinterpret_cast<P*>(out + row * dim);
        for (i64 w = lane; w < packs; w += 32) {
            const P in = s[w];
            P res;
#pragma unroll
            for (int v = 0; v < V; ++v) res.v[v] = store<T>(mul_rn(to_compute(in.v[v]), a));
            d[w] = res;
        }
    }
}

// out[t] = sum_k w[t, k] * y[pos[t, k]] in k order from 0 (w == nullptr: w = 1); one block per
// token, V elements per thread and access.
template <typename T, int V>
__device__ __forceinline__ void combine_rows(const T* __restrict__ y, const i64* __restrict__ pos,
                                             const typename Compute<T>::type* __restrict__ w,
                                             T* __restrict__ out, i64 tokens, i64 top_k, i64 dim, i64 num_rows) {
    typedef typename Compute<T>::type C;
    typedef Pack<T, V> P;
    const i64 packs = dim / V;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        for (i64 c = threadIdx.x; c < packs; c += blockDim.x) {
            C acc[V];
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v] = C(0);
            for (i64 k = 0; k < top_k; ++k) {
                const i64 r = pos[t * top_k + k];
                if (r < 0 || r >= num_rows) continue;
                const P in = reinterpret_cast<const P*>(y + r * dim)[c];
                if (w != nullptr) {
                    const C wk = w[t * top_k + k];
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] = add_rn(acc[v], mul_rn(wk, to_compute(in.v[v])));
                } else {
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] = add_rn(acc[v], to_compute(in.v[v]));
                }
            }
            P res;
#pragma unroll
            for (int v = 0; v < V; ++v) res.v[v] = store<T>(acc[v]);
            reinterpret_cast<P*>(out + t * dim)[c] = res;
        }
    }
}

// grad_w[t, k] = dot(grad[t], y[pos[t, k]]) in the compute type; one warp per pair, lanes stride
// over D and reduce with shuffles.
template <typename T>
__device__ __forceinline__ void weight_grad(const T* __restrict__ grad, const T* __restrict__ y,
                                            const i64* __restrict__ pos,
                                            typename Compute<T>::type* __restrict__ out,
                                            i64 pairs, i64 top_k, i64 dim, i64 num_rows) {
    typedef typename Compute<T>::type C;
    const int lane = lane_id();
    for (i64 p = global_warp(); p < pairs; p += warps_in_grid()) {
        const i64 r = pos[p];
        if (r < 0 || r >= num_rows) {  // a dropped pair: no row, no gradient for its weight
            if (lane == 0) out[p] = C(0);
            continue;
        }
        const T* g = grad + (p / top_k) * dim;
        const T* row = y + r * dim;
        C acc = C(0);
        for (i64 d = lane; d < dim; d += 32) acc = add_rn(acc, mul_rn(to_compute(g[d]), to_compute(row[d])));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc = add_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
        if (lane == 0) out[p] = acc;
    }
}

// -- extern "C" entry points, one per dtype (suffix) and vector width ----------------------------

#define MOEB_FLOAT_KERNELS(T, C, SUFFIX, VEC)                                                              \
    extern "C" __global__ void gather_rows_scaled_##SUFFIX(const T* x, const i64* index, const C* scale, \
                                                           T* out, i64 n, i64 dim, i64 num_rows) {        \
        gather_scaled<T, 1>(x, index, scale, out, n, dim, num_rows);                                      \
    }                                                                                                     \
    extern "C" __global__ void gather_rows_scaled_##SUFFIX##_vec(const T* x, const i64* index,           \
                                                                 const C* scale, T* out, i64 n, i64 dim, \
                                                                 i64 num_rows) {                         \
        gather_scaled<T, VEC>(x, index, scale, out, n, dim, num_rows);                                    \
    }                                                                                                     \
    extern "C" __global__ void combine_##SUFFIX(const T* y, const i64* pos, const C* w, T* out,          \
                                                i64 tokens, i64 top_k, i64 dim, i64 num_rows) {           \
        combine_rows<T, 1>(y, pos, w, out, tokens, top_k, dim, num_rows);                                 \
    }                                                                                                     \
    extern "C" __global__ void combine_##SUFFIX##_vec(const T* y, const i64* pos, const C* w, T* out,    \
                                                      i64 tokens, i64 top_k, i64 dim, i64 num_rows) {     \
        combine_rows<T, VEC>(y, pos, w, out, tokens, top_k, dim, num_rows);                               \
    }                                                                                                     \
    extern "C" __global__ void combine_weight_grad_##SUFFIX(const T* grad, const T* y, const i64* pos,   \
                                                            C* out, i64 pairs, i64 top_k, i64 dim,       \
                                                            i64 num_rows) {                              \
        weight_grad<T>(grad, y, pos, out, pairs, top_k, dim, num_rows);                                   \
    }

MOEB_FLOAT_KERNELS(float, float, f32, 4)
MOEB_FLOAT_KERNELS(double, double, f64, 2)
MOEB_FLOAT_KERNELS(bf16_t, float, bf16, 8)
MOEB_FLOAT_KERNELS(f16_t, float, f16, 8)
