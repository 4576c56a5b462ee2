/*
 * Threading on the process's OpenMP runtime (torch's, its entry points handed over by gefen_set_threading): parallel
 * loops of independent tasks split by cost, a barrier of one region's threads, and several loops in one region.
 * Included by gefen_kernels.c (one shared library, one translation unit).
 */
/* ------------------------------------------------------------------ threading (the process's OpenMP runtime) */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static gomp_parallel_fn g_parallel = 0;
static omp_int_fn g_thread_num = 0;
static omp_int_fn g_num_threads = 0;

void gefen_set_threading(void *parallel, void *thread_num, void *num_threads) {
    g_parallel = (gomp_parallel_fn)parallel;
    g_thread_num = (omp_int_fn)thread_num;
    g_num_threads = (omp_int_fn)num_threads;
}

typedef void (*task_fn)(const void *ctx, int64_t task, int64_t thread);
typedef struct {
    task_fn fn;
    const void *ctx;
    int64_t tasks;
    const int64_t *cost; /* (tasks + 1,) cumulative cost of the tasks (elements), or NULL: equal costs */
} pool_job;

/* First task whose cumulative cost reaches `target` (cost is non-decreasing). */
static int64_t first_reaching(const int64_t *cost, int64_t tasks, int64_t target) {
    int64_t lo = 0, hi = tasks;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (cost[mid] < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Thread k of n takes a contiguous range of tasks: equal counts, or equal costs when costs are given. */
static void task_range(const pool_job *job, int64_t k, int64_t n, int64_t *lo, int64_t *hi) {
    if (!job->cost) {
        *lo = job->tasks * k / n;
        *hi = job->tasks * (k + 1) / n;
        return;
    }
    const int64_t total = job->cost[job->tasks];
    *lo = k == 0 ? 0 : first_reaching(job->cost, job->tasks, total / n * k + total % n * k / n);
    *hi = k == n - 1 ? job->tasks
                     : first_reaching(job->cost, job->tasks, total / n * (k + 1) + total % n * (k + 1) / n);
}

static void pool_worker(void *data) {
    const pool_job *job = (const pool_job *)data;
    int64_t n = g_num_threads(), k = g_thread_num(), lo, hi;
    task_range(job, k, n, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) job->fn(job->ctx, t, k);
}

/* Run fn(ctx, t, thread) for t in [0, tasks) on at most `threads` threads (thread < threads), each thread taking
 * a contiguous range of about equal cost (cost: cumulative, (tasks + 1,), or NULL for equal tasks). Every task is
 * independent, so the result never depends on the threads. */
static void parallel_for_cost(int64_t tasks, int64_t threads, task_fn fn, const void *ctx, const int64_t *cost) {
    if (threads > tasks) threads = tasks;
    if (threads <= 1 || !g_parallel) {
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t, 0);
        return;
    }
    pool_job job = {fn, ctx, tasks, cost};
    g_parallel(pool_worker, &job, (unsigned)threads, 0);
}

/* A barrier of the threads of one parallel region: phase counting, spin, then yield the core (a thread that is
 * not running gets it). `phase` is the caller's own count of the barriers it has passed. */
typedef struct {
    atomic_int arrived, phase;
} team_barrier;

static void team_wait(team_barrier *b, int64_t team, int *phase) {
    const int mine = *phase;
    *phase = mine + 1;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == team - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, mine + 1, memory_order_release);
        return;
    }
    for (int64_t spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == mine; spins++) {
        if (spins > 20000) sched_yield();
#if GEFEN_X86
        else _mm_pause();
#endif
    }
}

/* Parallel loops run back to back in one parallel region, a barrier between them: a region per loop costs a
 * wake-up of the idle OpenMP workers each time they have gone to sleep (libgomp sleeps after a short spin when its
 * wait policy is passive, or throttled), ~30 us a region on a 2-core VM. Before a loop, `before` (if any) runs on
 * thread 0 alone after the previous loop; it may set a later loop's tasks to 0. */
typedef struct {
    task_fn fn;
    const void *ctx;
    int64_t tasks;
    const int64_t *cost; /* as parallel_for_cost's */
    void (*before)(void *state);
    void *state;
} loop_phase;

typedef struct {
    loop_phase *phases;
    int64_t count;
    team_barrier barrier;
} phases_job;

static void phases_worker(void *data) {
    phases_job *job = (phases_job *)data;
    const int64_t n = g_num_threads(), k = g_thread_num();
    int phase = 0;
    for (int64_t i = 0; i < job->count; i++) {
        loop_phase *ph = &job->phases[i];
        if (ph->before) {
            if (k == 0) ph->before(ph->state);
            if (n > 1) team_wait(&job->barrier, n, &phase);
        }
        if (ph->tasks > 0) {
            const pool_job pj = {ph->fn, ph->ctx, ph->tasks, ph->cost};
            int64_t lo, hi;
            task_range(&pj, k, n, &lo, &hi);
            for (int64_t t = lo; t < hi; t++) ph->fn(ph->ctx, t, k);
        }
        if (n > 1 && i + 1 < job->count) team_wait(&job->barrier, n, &phase); /* the next loop reads this one's */
    }
}

/* The loops phases[0..count) in order on at most `threads` threads, each as parallel_for_cost would run it. */
static void parallel_phases(loop_phase *phases, int64_t count, int64_t threads) {
    if (threads <= 1 || !g_parallel) {
        for (int64_t i = 0; i < count; i++) {
            if (phases[i].before) phases[i].before(phases[i].state);
            for (int64_t t = 0; t < phases[i].tasks; t++) phases[i].fn(phases[i].ctx, t, 0);
        }
        return;
    }
    phases_job job = {phases, count, {0, 0}};
    atomic_init(&job.barrier.arrived, 0);
    atomic_init(&job.barrier.phase, 0);
    g_parallel(phases_worker, &job, (unsigned)threads, 0);
}
