// The per-step re-split of one layer on the GPU: moebalance/dispatch/resplit_kernel.py's
// resplit_layer, the same arithmetic in the same order, in one launch of one block.
//
// Water-filling sweeps run a colour class at a time, one thread per expert of the class (no two
// experts of a class share a device, so they commute exactly with the sequential order); the
// exact flow (Newton's method with Dinic's phases) is sequential and runs on thread 0. Scratch
// comes from the caller (torch's allocator): no allocation, no host sync.
//
// Layouts (row-major, int64 indices, float64 values): w[E], device[E, X] (-1 padded, replicas
// first), speed[G], order[V] and class_starts[C + 1] from resplit_order, share[E, X] in/out,
// load[G] out. Scratch: fwork[E * X + E + 3 * G], iwork[E * X + 6 * E + 6 * G + 4].
// Compiled with --fmad=false so that a * b + c rounds twice, as Numba and numpy do.

#define MAX_REPLICAS 64

typedef long long i64;

extern "C" {

__device__ double water_fill(i64 e, const double* w, const i64* device, const double* speed,
                             double* share, double* load, i64 X) {
    double base[MAX_REPLICAS], level[MAX_REPLICAS];
    int order[MAX_REPLICAS];
    const double we = w[e];
    int n = 0;
    for (i64 j = 0; j < X; ++j) {
        i64 g = device[e * X + j];
        if (g < 0) break;
        base[j] = load[g] - we * share[e * X + j];
        level[j] = base[j] / speed[g];
        order[j] = (int)j;
        ++n;
    }
    for (int a = 1; a < n; ++a) {
        int b = a;
        while (b > 0 && level[order[b]] < level[order[b - 1]]) {
            int tmp = order[b]; order[b] = order[b - 1]; order[b - 1] = tmp;
            --b;
        }
    }
    double acc_load = we, acc_rate = 0.0, lam = 0.0;
    for (int k = 0; k < n; ++k) {
        int j = order[k];
        acc_load += base[j];
        acc_rate += speed[device[e * X + j]];
        lam = acc_load / acc_rate;
        if (k + 1 == n || lam <= level[order[k + 1]]) break;
    }
    double placed = 0.0;
    for (int j = 0; j < n; ++j) {
        double piece = lam * speed[device[e * X + j]] - base[j];
        if (piece < 0.0) piece = 0.0;
        level[j] = piece;
        placed += piece;
    }
    if (placed <= 0.0) return 0.0;
    double change = 0.0;
    for (int j = 0; j < n; ++j) {
        double s = level[j] / placed;
        double moved = fabs(we * s - we * share[e * X + j]);
        if (moved > change) change = moved;
        share[e * X + j] = s;
        load[device[e * X + j]] = base[j] + we * s;
    }
    return change;
}

__device__ double resplit_bound(const double* w, const i64* device, const double* speed,
                                const double* load, i64 E, i64 X, i64 G, double* time,
                                double* enters, i64* by_time, i64* rank) {
    for (i64 g = 0; g < G; ++g) {
        time[g] = -load[g] / speed[g];
        by_time[g] = g;
    }
    // stable insertion sort, as numpy's mergesort orders ties
    for (i64 a = 1; a < G; ++a) {
        i64 b = a;
        while (b > 0 && time[by_time[b]] < time[by_time[b - 1]]) {
            i64 tmp = by_time[b]; by_time[b] = by_time[b - 1]; by_time[b - 1] = tmp;
            --b;
        }
    }
    for (i64 k = 0; k < G; ++k) { rank[by_time[k]] = k; enters[k] = 0.0; }
    for (i64 e = 0; e < E; ++e) {
        i64 last = 0;
        for (i64 j = 0; j < X; ++j) {
            i64 g = device[e * X + j];
            if (g < 0) break;
            if (rank[g] > last) last = rank[g];
        }
        enters[last] += w[e];
    }
    double best = 0.0, pairs = 0.0, sp = 0.0;
    for (i64 k = 0; k < G; ++k) {
        pairs += enters[k];
        sp += speed[by_time[k]];
        best = fmax(best, pairs / sp);
    }
    return best;
}

__device__ void resplit_flow(const double* w, const i64* device, const double* speed,
                             double* share, double* load, i64 E, i64 X, i64 G, double* fwork,
                             i64* iwork) {
    double total = 0.0;
    for (i64 e = 0; e < E; ++e) total += w[e];
    if (total <= 0.0 || X < 2) return;
    const double eps = 1e-12 * total;
    double* flow = fwork;
    double* rest = flow + E * X;
    double* fixed = rest + E;
    double* time = fixed + G;
    double* enters = time + G;
    i64* starts = iwork;              // G + 1
    i64* fill = starts + G + 1;       // G
    i64* held = fill + G;             // E * X
    i64* level_e = held + E * X;      // E
    i64* level_g = level_e + E;       // G
    i64* next_e = level_g + G;        // E
    i64* next_g = next_e + E;         // G
    i64* queue = next_g + G;          // E
    i64* path_e = queue + E;          // E + 1
    i64* path_j = path_e + E + 1;     // E + 1
    i64* path_r = path_j + E + 1;     // E + 1
    i64* by_time = path_r + E + 1;    // G
    i64* rank = by_time + G;          // G

    for (i64 g = 0; g <= G; ++g) starts[g] = 0;
    for (i64 g = 0; g < G; ++g) fixed[g] = 0.0;
    for (i64 e = 0; e < E; ++e) {
        if (device[e * X + 1] < 0) {
            fixed[device[e * X]] += w[e];
        } else if (w[e] > 0.0) {
            for (i64 j = 0; j < X; ++j) {
                i64 g = device[e * X + j];
                if (g >= 0) starts[g + 1] += 1;
            }
        }
    }
    for (i64 g = 0; g < G; ++g) starts[g + 1] += starts[g];
    for (i64 g = 0; g < G; ++g) fill[g] = starts[g];
    for (i64 e = 0; e < E; ++e) {
        if (device[e * X + 1] >= 0 && w[e] > 0.0) {
            for (i64 j = 0; j < X; ++j) {
                i64 g = device[e * X + j];
                if (g >= 0) held[fill[g]++] = e * X + j;
            }
        }
    }
    for (i64 e = 0; e < E; ++e)
        for (i64 j = 0; j < X; ++j)
            flow[e * X + j] = device[e * X + j] >= 0 ? w[e] * share[e * X + j] : 0.0;
    double t = 0.0;
    for (i64 g = 0; g < G; ++g) t = fmax(t, fixed[g] / speed[g]);
    t = fmax(t, resplit_bound(w, device, speed, load, E, X, G, time, enters, by_time, rank));
    for (i64 e = 0; e < E; ++e) rest[e] = 0.0;
    for (i64 g = 0; g < G; ++g) {
        double excess = load[g] - t * speed[g];
        i64 r = starts[g];
        while (excess > eps && r < starts[g + 1]) {
            i64 f = held[r];
            double cut = fmin(excess, flow[f]);
            if (cut > 0.0) {
                flow[f] -= cut;
                rest[f / X] += cut;
                load[g] -= cut;
                excess -= cut;
            }
            ++r;
        }
    }
    double waiting = 0.0;
    for (i64 e = 0; e < E; ++e) waiting += rest[e];

    for (i64 phase = 0; phase < 4 * (E + G); ++phase) {
        if (waiting <= eps * 16) break;
        for (i64 e = 0; e < E; ++e) level_e[e] = -1;
        for (i64 g = 0; g < G; ++g) level_g[g] = -1;
        i64 head = 0, tail = 0;
        for (i64 e = 0; e < E; ++e) {
            if (rest[e] > eps) { level_e[e] = 0; queue[tail++] = e; }
        }
        i64 sink_level = -1;
        while (head < tail) {
            i64 e = queue[head++];
            if (sink_level >= 0 && level_e[e] + 1 > sink_level) break;
            for (i64 j = 0; j < X; ++j) {
                i64 g = device[e * X + j];
                if (g < 0) break;
                if (level_g[g] >= 0) continue;
                level_g[g] = level_e[e] + 1;
                if (load[g] < t * speed[g] - eps) { sink_level = level_g[g]; continue; }
                for (i64 r = starts[g]; r < starts[g + 1]; ++r) {
                    i64 f = held[r] / X;
                    if (level_e[f] < 0 && flow[held[r]] > eps) {
                        level_e[f] = level_g[g] + 1;
                        queue[tail++] = f;
                    }
                }
            }
        }
        if (sink_level < 0) {
            double reached_w = 0.0, reached_speed = 0.0;
            for (i64 e = 0; e < E; ++e) if (level_e[e] >= 0) reached_w += w[e];
            for (i64 g = 0; g < G; ++g) {
                if (level_g[g] >= 0) { reached_w += fixed[g]; reached_speed += speed[g]; }
            }
            t = fmax(t * (1.0 + 1e-12), reached_w / reached_speed);
            continue;
        }
        for (i64 e = 0; e < E; ++e) next_e[e] = 0;
        for (i64 g = 0; g < G; ++g) next_g[g] = starts[g];
        for (i64 s = 0; s < E; ++s) {
            if (level_e[s] != 0) continue;
            i64 depth = 0;
            path_e[0] = s;
            while (rest[s] > eps && level_e[s] == 0) {
                i64 e = path_e[depth];
                i64 g = -1;
                while (next_e[e] < X && device[e * X + next_e[e]] >= 0) {
                    i64 h = device[e * X + next_e[e]];
                    if (level_g[h] == level_e[e] + 1) { g = h; break; }
                    ++next_e[e];
                }
                if (g < 0) {
                    level_e[e] = -1;
                    if (depth > 0) --depth;
                    continue;
                }
                path_j[depth] = next_e[e];
                if (level_g[g] == sink_level) {
                    if (load[g] >= t * speed[g] - eps) { level_g[g] = -1; continue; }
                    double amount = fmin(rest[s], t * speed[g] - load[g]);
                    for (i64 k = 1; k <= depth; ++k) amount = fmin(amount, flow[held[path_r[k]]]);
                    for (i64 k = 0; k <= depth; ++k) {
                        flow[path_e[k] * X + path_j[k]] += amount;
                        if (k > 0) flow[held[path_r[k]]] -= amount;
                    }
                    load[g] += amount;
                    rest[s] -= amount;
                    waiting -= amount;
                    if (load[g] >= t * speed[g] - eps) level_g[g] = -1;
                    depth = 0;
                    continue;
                }
                i64 f = -1;
                while (next_g[g] < starts[g + 1]) {
                    i64 r = next_g[g];
                    i64 c = held[r] / X;
                    if (level_e[c] == level_g[g] + 1 && flow[held[r]] > eps) { f = c; break; }
                    ++next_g[g];
                }
                if (f < 0) {
                    level_g[g] = -1;
                    ++next_e[e];
                    continue;
                }
                ++depth;
                path_e[depth] = f;
                path_r[depth] = next_g[g];
            }
        }
    }
    for (i64 e = 0; e < E; ++e) {
        if (w[e] <= 0.0 || device[e * X + 1] < 0) continue;
        double placed = 0.0;
        for (i64 j = 0; j < X; ++j) placed += flow[e * X + j];
        if (placed > 0.0)
            for (i64 j = 0; j < X; ++j) share[e * X + j] = flow[e * X + j] / placed;
    }
}

// One layer: launch with one block (any width); share is updated in place, load written.
__global__ void resplit_layer(const double* w, const i64* device, const double* speed,
                              const i64* order, const i64* class_starts, double* share,
                              double* load, i64 E, i64 X, i64 G, i64 C, i64 sweeps, i64 exact,
                              double* fwork, i64* iwork) {
    const int tid = threadIdx.x;
    // loads in the order Numba sums them: expert by expert
    for (i64 g = tid; g < G; g += blockDim.x) {
        double acc = 0.0;
        for (i64 e = 0; e < E; ++e)
            for (i64 j = 0; j < X; ++j)
                if (device[e * X + j] == g) acc += w[e] * share[e * X + j];
        load[g] = acc;
    }
    __syncthreads();
    if (C == 0) return;
    for (i64 sweep = 0; sweep < sweeps; ++sweep) {
        for (i64 k = 0; k < C; ++k) {
            i64 c = sweep % 2 == 0 ? k : C - 1 - k;
            for (i64 i = class_starts[c] + tid; i < class_starts[c + 1]; i += blockDim.x) {
                i64 e = order[i];
                if (w[e] > 0.0) water_fill(e, w, device, speed, share, load, X);
            }
            __syncthreads();
        }
    }
    if (exact && tid == 0) resplit_flow(w, device, speed, share, load, E, X, G, fwork, iwork);
}

}  // extern "C"
