/* A team of threads for the CPU kernels that split one short job many ways (a decode step's layers: a few ms, with
 * ten points a layer where the threads must wait for each other). OpenMP would do it, but the engine calls
 * these kernels from its own thread, not the process's first one: libgomp then keeps a second pool beside the
 * first thread's, counts more threads than cores and makes every barrier sleep in the kernel instead of spinning,
 * which costs a decode step a third of its time. Here the workers spin a while between jobs and at barriers (a
 * decode step calls again within microseconds), then sleep or yield, so a core another process wants is given back.
 * Where the cores are taken by other processes, a team in lockstep loses most of its time waiting for a member
 * the OS holds back (several times the work of one thread alone): a job whose threads spent more time waiting for
 * each other than the job lasted, per thread beside the caller, makes the next jobs run on the calling thread
 * alone for a while, then a team is tried again.
 *
 * pool_run(fn, arg, team) runs fn(arg, id, team) on the calling thread (id 0) and team - 1 workers, and returns
 * when all are done; inside, pool_barrier(team) waits for the whole team and pool_next(counter) hands out work
 * items to whichever thread asks first.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define POOL_MAX 64
#define SPIN_JOB (1 << 12)     /* pauses (~0.1 ms) a worker waits for the next job before it sleeps */
#define SPIN_BARRIER (1 << 8)  /* pauses at a barrier between yields of the core (to a thread of ours on it) */
#define SOLO_NS 200000000      /* how long jobs then run alone: a few dozen decode steps */

typedef void (*PoolFn)(void *arg, int id, int team);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;
    atomic_int generation, running, arrived, released;
    atomic_llong waited; /* ns the team spent in long waits during the job */
    int64_t solo_until; /* jobs run on the calling thread alone until then (ns) */
    PoolFn fn;
    void *arg;
    int team;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One turn of a wait loop: a pause, and every SPIN_BARRIER turns the core given up; a wait that lasts that long
 * is timed (from *since, set at its first yield) for the contention check. */
static inline void pool_wait_turn(int i, int64_t *since) {
    if (i % SPIN_BARRIER == SPIN_BARRIER - 1) {
        if (*since == 0) *since = now_ns();
        sched_yield();
    } else {
        PAUSE();
    }
}

static inline void pool_waited(int64_t since) {
    if (since) atomic_fetch_add_explicit(&pool.waited, now_ns() - since, memory_order_relaxed);
}

/* The generation each worker was started in: the jobs after it are its to run. */
static int start_generation[POOL_MAX];

static void *pool_worker(void *p) {
    const int id = (int)(intptr_t)p;
    int seen = start_generation[id];
    for (;;) {
        for (int i = 0; i < SPIN_JOB && atomic_load_explicit(&pool.generation, memory_order_acquire) == seen; i++)
            PAUSE();
        if (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (id < pool.team) pool.fn(pool.arg, id, pool.team);
        atomic_fetch_sub_explicit(&pool.running, 1, memory_order_release);
    }
    return NULL;
}

/* One job at a time: callers on several threads take turns. */
static pthread_mutex_t pool_caller = PTHREAD_MUTEX_INITIALIZER;

/* A fork waits for the job under way (the forking thread takes the callers' lock), and the child, which has none
 * of its parent's workers, starts its own. Registered when the library loads: a process that never grew a team
 * still takes the callers' lock on every call. */
static void pool_fork_prepare(void) { pthread_mutex_lock(&pool_caller); }
static void pool_fork_parent(void) { pthread_mutex_unlock(&pool_caller); }
static void pool_fork_child(void) {
    pool.workers = 0;
    pthread_mutex_unlock(&pool_caller);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

__attribute__((constructor)) static void pool_register_fork(void) {
    pthread_atfork(pool_fork_prepare, pool_fork_parent, pool_fork_child);
}

/* Workers up to `team` - 1 (started once, kept for the process); the team that can run: fewer where threads can
 * not be made. */
static int pool_grow(int team) {
    if (team > POOL_MAX) team = POOL_MAX;
    while (pool.workers < team - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[pool.workers + 1] = atomic_load(&pool.generation);
        const int failed = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    return pool.workers + 1 < team ? pool.workers + 1 : team;
}

static void pool_run(PoolFn fn, void *arg, int team) {
    pthread_mutex_lock(&pool_caller);
    team = team > 1 && (pool.solo_until == 0 || now_ns() > pool.solo_until) ? pool_grow(team) : 1;
    if (team == 1) {
        fn(arg, 0, 1);
        pthread_mutex_unlock(&pool_caller);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    pool.team = team;
    atomic_store(&pool.arrived, 0);
    atomic_store(&pool.waited, 0);
    const int64_t began = now_ns();
    atomic_store(&pool.running, pool.workers); /* those outside the team too: each job seen by all before the next */
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(arg, 0, team);
    int64_t since = 0;
    for (int i = 0; atomic_load_explicit(&pool.running, memory_order_acquire) > 0; i++) pool_wait_turn(i, &since);
    pool_waited(since);
    const int64_t ended = now_ns();
    /* each of the team's other threads may wait up to the job's length (serial parts, short work lists) */
    pool.solo_until = atomic_load(&pool.waited) > (int64_t)(team - 1) * (ended - began) ? ended + SOLO_NS : 0;
    pthread_mutex_unlock(&pool_caller);
}

/* Wait until the whole team has arrived (every write before it is then seen by every thread). */
static void pool_barrier(int team) {
    if (team == 1) return;
    const int release = atomic_load_explicit(&pool.released, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == team - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.released, 1, memory_order_release);
        return;
    }
    int64_t since = 0;
    for (int i = 0; atomic_load_explicit(&pool.released, memory_order_acquire) == release; i++)
        pool_wait_turn(i, &since);
    pool_waited(since);
}

/* The next work item of a shared counter (items past the last mean none is left). */
static inline int64_t pool_next(atomic_llong *counter) {
    return atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);
}
