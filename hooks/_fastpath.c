/* The tracker's hot paths in C: one call per phase transition instead of a Python frame of ~40 bytecodes.
 *
 * ``Core`` is the base class of ``tracker.CTracker``; ``tracker.PyCore`` is the same code in Python, the
 * fallback where this module was not built, and the reference the tests compare this one against
 * (tests/unit/hooks/test_record_ring.py runs every case on both; test_fastpath_equivalence.py replays random
 * call sequences on both and compares the records byte for byte). Only the common path lives here:
 * the event word, the count, the open-phase stack, the step's end. Everything rare (budgets, folds,
 * unbalanced exits, a phase an exception left, op names, the GPU harvest) calls back into the Python
 * methods of the subclass, so each rule has one copy. The record's layout comes from ``_bind`` (numbers
 * from ``record.py``), never from constants here. ``Phase`` wraps a training function (instrument.py's
 * wrappers), ``PhaseState`` holds what a wrapper keeps between calls (DDP timing's split, the forward's
 * nesting) and ``GradReady`` is DDP timing's gradient hook: no Python frame of the hook's runs in a step.
 *
 * Like the Python code, no method raises into training: an internal error calls ``self._fail(exc)``,
 * which disables tracking. Stores are plain word stores; the count (and the seqlock word) are written
 * with release order after what they publish, as the reader expects.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <time.h>

#define N_SLOTS 32 /* an event word's arg field: 5 bits */
#define P2P_CAP 16 /* the record's p2p_known slots at most (record.P2P_SLOTS, checked by _bind) */
#define STK0 4     /* open phases held in the Core itself (a step nests 1-2: optimizer, backward under it) */

/* one phase slot's event words less the clock, and its open word's code (an exit reads ``out`` and
 * ``enter_code``: side by side) */
typedef struct {
    uint64_t in, out, enter_code, fail, batch, split;
} SlotCodes;

/* A transition runs between long stretches of torch's work, which evict the hook's lines from the L1
 * caches (callgrind: the hook's cost per step is mostly L1 misses, not instructions). So what one
 * transition reads sits together: the hot fields in the first two lines, a slot's codes in one line, the
 * open phases in a C array (no int objects made and freed per phase, no list). */
typedef struct {
    PyObject_HEAD
    /* hot: every transition */
    uint64_t *q;
    long long tid;                  /* the thread that may write (-1: disabled) */
    unsigned long long ev_n, slow_at;
    Py_ssize_t w_ev, w_ev_count;
    uint64_t ev_mask, ns_bits;
    uint64_t *stk;                  /* open phases' enter words, outermost first: stk0, or the heap past it */
    Py_ssize_t depth, cap;
    uint64_t stk0[STK0];            /* the usual few open phases, in the lines the transition reads anyway */
    int bound, py_clock;            /* py_clock: ``clock`` is a Python callable (tests) */
    int has_budgets;                /* mirror of ``len(_budgets) > 0``: such an exit takes the slow path */
    int has_last_op;
    uint64_t last_op;               /* the last collective's enter word less the clock */
    long long colls;
    uint64_t max_phases;
    uint64_t gpu_on;                /* the slots timed on the GPU while a pool is attached (``_gpu``), else 0 */
    /* per slot */
    SlotCodes codes[N_SLOTS];
    uint64_t k_coll_in, k_coll_out;
    /* the record */
    Py_buffer view;
    Py_ssize_t nwords;
    /* layout (word indices and sizes, from record.py via _bind) */
    Py_ssize_t w_seq, w_steps_done, w_ring, w_input;
    uint64_t ring_slots, entry_words, e_cp, max_stack;
    uint64_t gpu_slots; /* bit mask of slots timed on the GPU */
    int coll_slot, opt_slot;
    /* send/recv peers (rare next to the phases: past the hot lines): p2p_last's word and the peers on record */
    Py_ssize_t w_p2p_last, w_p2p_known_n, w_p2p_known;
    uint64_t p2p_slots, p2p_seq_bits, p2p_unknown, p2p_n;
    uint64_t p2p_known[P2P_CAP];
    /* state shared with the Python methods (members below) */
    long long thread_id;
    unsigned long long seq, steps_done, step_start, seen_ns, seen_batches, origin;
    long long input_slots_used, input_workers;
    char explicit_steps;
    PyObject *budgets, *gpu, *ops, *frozen, *clock, *after_step;
} Core;

static PyObject *s_require_sync, *s_stamp, *s_gate_kw;
static PyObject *s_entered_slow, *s_exited_slow, *s_fail, *s_op_word, *s_harvest_gpu;
static PyObject *s_dst, *s_src;

/* -- helpers ----------------------------------------------------------------------------------------- */

/* PyThread_get_thread_ident() without its two calls: on glibc and musl (x86-64, aarch64) pthread_self()
 * is the thread pointer; exec_module checks that on the importing thread before the hot paths use it */
static int tp_is_ident;

static inline long long thread_ident(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__))
    if (__builtin_expect(tp_is_ident, 1)) return (long long)(uintptr_t)__builtin_thread_pointer();
#endif
    return (long long)PyThread_get_thread_ident();
}

static inline int on_thread(Core *self) {
    return self->bound && thread_ident() == self->tid;
}

/* 0 and an exception set when a Python clock fails */
static inline int now_ns(Core *self, uint64_t *out) {
    if (__builtin_expect(!self->py_clock, 1)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        *out = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        return 1;
    }
    PyObject *r = PyObject_CallNoArgs(self->clock);
    if (r == NULL) return 0;
    *out = PyLong_AsUnsignedLongLongMask(r);
    Py_DECREF(r);
    return !PyErr_Occurred();
}

static inline void put(Core *self, uint64_t n, uint64_t w) {
    __atomic_store_n(&self->q[self->w_ev + (Py_ssize_t)(n & self->ev_mask)], w, __ATOMIC_RELAXED);
}

static inline void publish_count(Core *self, uint64_t n) {
    self->ev_n = n;
    __atomic_store_n(&self->q[self->w_ev_count], n, __ATOMIC_RELEASE);
}

static inline void set_seq(Core *self, uint64_t v) {
    __atomic_store_n(&self->q[self->w_seq], v, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* the error path of every public method: self._fail(exc) for an Exception, other BaseExceptions go on */
static __attribute__((cold, noinline)) PyObject *fail(Core *self) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_fail, exc ? exc : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    Py_RETURN_NONE;
}

static __attribute__((cold, noinline)) int grow(Core *self, Py_ssize_t need) {
    Py_ssize_t cap = self->cap > STK0 ? self->cap : 16;
    while (cap < need) cap *= 2;
    int inline_ = self->stk == self->stk0;
    uint64_t *p = PyMem_Realloc(inline_ ? NULL : self->stk, (size_t)cap * sizeof(uint64_t));
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (inline_) memcpy(p, self->stk0, (size_t)self->depth * sizeof(uint64_t));
    self->stk = p;
    self->cap = cap;
    return 0;
}

static inline int push(Core *self, uint64_t w) {
    if (__builtin_expect(self->depth >= self->cap, 0) && grow(self, self->depth + 1) < 0) return -1;
    self->stk[self->depth++] = w;
    return 0;
}

/* the Python slow paths (``_entered_slow`` appends a budget, ``_exited_slow`` rebuilds the list) */
static void refresh_budgets(Core *self) {
    self->has_budgets = !PyList_CheckExact(self->budgets) || PyList_GET_SIZE(self->budgets) != 0;
}

/* pop the innermost open phase when it is ``code`` and nothing rare is pending; 1 popped, 0 not */
static inline int pop_if(Core *self, uint64_t code) {
    Py_ssize_t n = self->depth;
    if (n == 0 || self->has_budgets || (self->stk[n - 1] >> self->ns_bits) != code) return 0;
    self->depth = n - 1;
    return 1;
}

static __attribute__((cold, noinline)) int call_method(Core *self, PyObject *name, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    PyObject *args = Py_VaBuildValue(fmt, va);
    va_end(va);
    if (args == NULL) return -1;
    PyObject *meth = PyObject_GetAttr((PyObject *)self, name);
    if (meth == NULL) {
        Py_DECREF(args);
        return -1;
    }
    PyObject *r = PyObject_Call(meth, args, NULL);
    Py_DECREF(meth);
    Py_DECREF(args);
    refresh_budgets(self);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static inline int gpu_call(Core *self, const char *method, int slot) {
    if (__builtin_expect(!self->gpu_on, 1) || slot < 0 || slot >= 64 || !((self->gpu_on >> slot) & 1)) return 0;
    PyObject *r = PyObject_CallMethod(self->gpu, method, "i", slot);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int slot_ok(Core *self, long slot) {
    if (slot < 0 || (uint64_t)slot >= self->max_phases || slot >= N_SLOTS) {
        PyErr_Format(PyExc_IndexError, "phase slot %ld out of range", slot);
        return 0;
    }
    return 1;
}

/* positional or keyword arguments into ``out`` (NULL: not given); 0 and a TypeError when they do not fit */
static int parse_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int n, int required, PyObject **out) {
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments", fn, n);
        return 0;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        const char *k = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, j));
        if (k == NULL) return 0;
        int found = 0;
        for (int i = 0; i < n && !found; i++)
            if (strcmp(k, names[i]) == 0) {
                if (out[i] != NULL) {
                    PyErr_Format(PyExc_TypeError, "%s() got multiple values for '%s'", fn, k);
                    return 0;
                }
                out[i] = args[nargs + j];
                found = 1;
            }
        if (!found) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fn, k);
            return 0;
        }
    }
    for (int i = 0; i < required; i++)
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing argument '%s'", fn, names[i]);
            return 0;
        }
    return 1;
}

static int parse_slot(PyObject *o, long *slot) {
    *slot = PyLong_AsLong(o);
    return !(*slot == -1 && PyErr_Occurred());
}

/* -- the checkpoint and the step's end (also called by the Python slow paths) --------------------------- */

static int write_cp(Core *self, Py_ssize_t base, uint64_t n, uint64_t at) {
    uint64_t *q = self->q;
    q[base] = n;
    q[base + 1] = at;
    q[base + 2] = (uint64_t)self->colls;
    q[base + 3] = self->has_last_op ? ((self->last_op + self->origin) >> self->ns_bits) & 31 : UINT64_MAX;
    uint64_t frozen = 0;
    if (self->frozen != NULL && self->frozen != Py_None) {
        PyObject *w = PySequence_GetItem(self->frozen, 0);
        if (w == NULL) return -1;
        frozen = PyLong_AsUnsignedLongLongMask(w);
        Py_DECREF(w);
        if (frozen == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    q[base + 4] = frozen;
    Py_ssize_t depth = self->depth;
    q[base + 5] = (uint64_t)depth;
    Py_ssize_t first = depth > (Py_ssize_t)self->max_stack ? depth - (Py_ssize_t)self->max_stack : 0;
    for (Py_ssize_t i = first; i < depth; i++) q[base + 6 + (i - first)] = self->stk[i];
    return 0;
}

static int end_step(Core *self, uint64_t now) {
    uint64_t busy = 0, batches = 0, *q = self->q;
    if (self->input_slots_used > 0) {
        for (long long i = 0; i < self->input_slots_used; i++) {
            busy += __atomic_load_n(&q[self->w_input + 2 * i], __ATOMIC_RELAXED);
            batches += __atomic_load_n(&q[self->w_input + 2 * i + 1], __ATOMIC_RELAXED);
        }
    }
    uint64_t done = self->steps_done;
    Py_ssize_t base = self->w_ring + (Py_ssize_t)((done % self->ring_slots) * self->entry_words);
    q[base] = done;
    q[base + 1] = self->step_start;
    q[base + 2] = now;
    q[base + 3] = busy > self->seen_ns ? busy - self->seen_ns : 0;
    q[base + 4] = batches > self->seen_batches ? batches - self->seen_batches : 0;
    q[base + 5] = (uint64_t)self->input_workers;
    self->seen_ns = busy;
    self->seen_batches = batches;
    if (write_cp(self, base + (Py_ssize_t)self->e_cp, self->ev_n, now) < 0) return -1;
    if (self->gpu != NULL && self->gpu != Py_None && call_method(self, s_harvest_gpu, "()") < 0) return -1;
    self->steps_done = done + 1;
    __atomic_store_n(&q[self->w_steps_done], done + 1, __ATOMIC_RELEASE);
    self->step_start = now;
    return 0;
}

/* -- public hot paths ------------------------------------------------------------------------------------ */

static PyObject *do_enter(Core *self, long slot, double budget_s) {
    if (!on_thread(self) || slot < 0) Py_RETURN_NONE;
    if (!slot_ok(self, slot)) return fail(self);
    uint64_t t;
    if (!now_ns(self, &t)) return fail(self);
    uint64_t w = self->codes[slot].in + t, n = self->ev_n;
    put(self, n, w);
    publish_count(self, ++n);
    if (push(self, w) < 0) return fail(self);
    if (n >= self->slow_at || budget_s != 0.0) {
        if (call_method(self, s_entered_slow, "(dK)", budget_s, (unsigned long long)n) < 0) return fail(self);
    }
    if (gpu_call(self, "begin", (int)slot) < 0) return fail(self);
    Py_RETURN_NONE;
}

static PyObject *Core_enter(Core *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[2] = {"slot", "budget_s"};
    PyObject *a[2];
    if (!parse_args("enter", args, nargs, kwnames, names, 2, 1, a)) return NULL;
    long slot;
    if (!parse_slot(a[0], &slot)) return NULL;
    double budget = 0.0;
    if (a[1] != NULL) {
        budget = PyFloat_AsDouble(a[1]);
        if (budget == -1.0 && PyErr_Occurred()) return NULL;
    }
    return do_enter(self, slot, budget);
}

/* exit/exit_batch/exit_step's common tail: store ``word``, pop or take the slow path */
static int closed(Core *self, uint64_t n, uint64_t word, long slot, uint64_t code, int failing) {
    put(self, n, word);
    publish_count(self, ++n);
    int popped = failing ? 0 : pop_if(self, code);
    if (popped < 0) return -1;
    if (!popped) {
        PyObject *f = failing ? Py_True : Py_False;
        if (call_method(self, s_exited_slow, "(lKO)", slot, (unsigned long long)n, f) < 0) return -1;
    }
    return 0;
}

static PyObject *do_exit(Core *self, long slot, uint64_t split, long tail, int failing);

static PyObject *Core_exit(Core *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[4] = {"slot", "split_ns", "tail_slot", "failing"};
    PyObject *a[4];
    if (!parse_args("exit", args, nargs, kwnames, names, 4, 1, a)) return NULL;
    long slot, tail = -1;
    if (!parse_slot(a[0], &slot)) return NULL;
    uint64_t split = 0;
    if (a[1] != NULL) {
        split = PyLong_AsUnsignedLongLongMask(a[1]);
        if (split == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    if (a[2] != NULL && !parse_slot(a[2], &tail)) return NULL;
    int failing = a[3] != NULL ? PyObject_IsTrue(a[3]) : 0;
    if (failing < 0) return NULL;
    return do_exit(self, slot, split, tail, failing);
}

static PyObject *do_exit(Core *self, long slot, uint64_t split, long tail, int failing) {
    if (!on_thread(self) || slot < 0) Py_RETURN_NONE;
    if (gpu_call(self, "end", (int)slot) < 0) return fail(self);
    if (!slot_ok(self, slot)) return fail(self);
    uint64_t n = self->ev_n;
    if (split && tail >= 0 && split > self->origin) {
        if (!slot_ok(self, tail)) return fail(self);
        put(self, n++, self->codes[tail].split + split);
    }
    uint64_t t;
    if (!now_ns(self, &t)) return fail(self);
    uint64_t w = (failing ? self->codes[slot].fail : self->codes[slot].out) + t;
    if (closed(self, n, w, slot, self->codes[slot].enter_code, failing) < 0) return fail(self);
    Py_RETURN_NONE;
}

static PyObject *do_exit_batch(Core *self, long slot, int produced);

static PyObject *Core_exit_batch(Core *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[2] = {"slot", "produced"};
    PyObject *a[2];
    if (!parse_args("exit_batch", args, nargs, kwnames, names, 2, 2, a)) return NULL;
    long slot;
    if (!parse_slot(a[0], &slot)) return NULL;
    int produced = PyObject_IsTrue(a[1]);
    if (produced < 0) return NULL;
    return do_exit_batch(self, slot, produced);
}

static PyObject *do_exit_batch(Core *self, long slot, int produced) {
    if (!on_thread(self)) Py_RETURN_NONE;
    if (!slot_ok(self, slot)) return fail(self);
    uint64_t t;
    if (!now_ns(self, &t)) return fail(self);
    uint64_t w = (produced ? self->codes[slot].batch : self->codes[slot].out) + t;
    if (closed(self, self->ev_n, w, slot, self->codes[slot].enter_code, 0) < 0) return fail(self);
    if (produced && self->input_workers) self->input_workers = 0;
    Py_RETURN_NONE;
}

/* the collective-enter word less the clock for ``op`` (declared on first use by ``_op_word``); 0 and an
 * exception set when that fails */
static int op_word(Core *self, PyObject *op, uint64_t *out) {
    PyObject *k = PyDict_Check(self->ops) ? PyDict_GetItemWithError(self->ops, op) : NULL;
    if (k != NULL) {
        Py_INCREF(k);
    } else {
        if (PyErr_Occurred()) return 0;
        k = PyObject_CallMethodOneArg((PyObject *)self, s_op_word, op);
        if (k == NULL) return 0;
    }
    *out = PyLong_AsUnsignedLongLongMask(k);
    Py_DECREF(k);
    return !(*out == (uint64_t)-1 && PyErr_Occurred());
}

/* on the tracker's thread */
static PyObject *coll_enter(Core *self, uint64_t kv) {
    uint64_t t;
    if (!now_ns(self, &t)) return fail(self);
    uint64_t n = self->ev_n;
    put(self, n, kv + t);
    publish_count(self, ++n);
    self->last_op = kv;
    self->has_last_op = 1;
    if (push(self, self->k_coll_in + t) < 0) return fail(self);
    self->colls++;
    if (n >= self->slow_at && call_method(self, s_entered_slow, "(dK)", 0.0, (unsigned long long)n) < 0)
        return fail(self);
    Py_RETURN_NONE;
}

/* a collective's enter on the tracker's thread (else nothing); ``cached``/``known``: its word kept by the
 * caller once declared (a wrapper's), or NULL */
static PyObject *collective_enter(Core *self, PyObject *op, uint64_t *cached, int *known) {
    if (!on_thread(self)) Py_RETURN_NONE;
    uint64_t kv;
    if (known != NULL && *known) {
        kv = *cached;
    } else {
        if (!op_word(self, op, &kv)) return fail(self);
        if (known != NULL) {
            *cached = kv;
            *known = 1;
        }
    }
    return coll_enter(self, kv);
}

static PyObject *Core_collective_enter(Core *self, PyObject *op) { return collective_enter(self, op, NULL, NULL); }

static PyObject *Core_collective_exit(Core *self, PyObject *Py_UNUSED(ignored)) {
    if (!on_thread(self)) Py_RETURN_NONE;
    uint64_t t;
    if (!now_ns(self, &t)) return fail(self);
    if (closed(self, self->ev_n, self->k_coll_out + t, self->coll_slot, self->codes[self->coll_slot].enter_code, 0) < 0)
        return fail(self);
    Py_RETURN_NONE;
}

/* -- send/recv peers (tracker.PyCore.p2p_enter / p2p_learn) --------------------------------------------- */

/* a send (direction 1) or recv (2) with ``peer`` (< 0: not named) enters next, on the tracker's thread: one
 * plain store, tagged with the collective count its enter gives it */
static inline void p2p_enter(Core *self, long long peer, long direction) {
    uint64_t p = peer >= 0 && (uint64_t)peer < self->p2p_unknown ? (uint64_t)peer : self->p2p_unknown;
    uint64_t seq = ((uint64_t)self->colls + 1) & ((1ULL << self->p2p_seq_bits) - 1);
    uint64_t dir_shift = self->p2p_seq_bits + (64 - __builtin_clzll(self->p2p_unknown));
    uint64_t w = (((uint64_t)direction & 3) << dir_shift) | (p << self->p2p_seq_bits) | seq;
    __atomic_store_n(&self->q[self->w_p2p_last], w, __ATOMIC_RELAXED);
}

/* a send/recv with ``peer`` completed: a new peer goes on record in a seqlock section (a few per job) */
static void p2p_learn(Core *self, long long peer) {
    if (peer < 0 || (uint64_t)peer >= self->p2p_unknown) return;
    uint64_t n = self->p2p_n, p = (uint64_t)peer;
    if (n > self->p2p_slots) return; /* full: whether a peer is new can no longer be said */
    for (uint64_t i = 0; i < n; i++)
        if (self->p2p_known[i] == p) return;
    uint64_t seq = self->seq + 1;
    set_seq(self, seq);
    if (n < self->p2p_slots) {
        self->q[self->w_p2p_known + (Py_ssize_t)n] = p;
        self->p2p_known[n] = p;
    }
    self->p2p_n = n + 1;
    self->q[self->w_p2p_known_n] = n + 1;
    self->seq = seq + 1;
    set_seq(self, seq + 1);
}

/* an int argument as a peer: -1 where it is none (not an int, negative, past a long long); never raises */
static long long peer_of(PyObject *v) {
    if (!PyLong_Check(v)) return -1;
    int overflow = 0;
    long long r = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (r == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return overflow || r < 0 ? -1 : r;
}

static PyObject *Core_p2p_enter(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "p2p_enter(peer, direction)");
        return NULL;
    }
    long direction = PyLong_AsLong(args[1]);
    if (direction == -1 && PyErr_Occurred()) return fail(self);
    if (on_thread(self)) p2p_enter(self, peer_of(args[0]), direction);
    Py_RETURN_NONE;
}

static PyObject *Core_p2p_learn(Core *self, PyObject *arg) {
    if (on_thread(self)) p2p_learn(self, peer_of(arg));
    Py_RETURN_NONE;
}

static PyObject *do_exit_step(Core *self, long slot) {
    if (!on_thread(self)) Py_RETURN_NONE;
    if (gpu_call(self, "end", (int)slot) < 0) return fail(self);
    if (!slot_ok(self, slot)) return fail(self);
    uint64_t t;
    if (!now_ns(self, &t)) return fail(self);
    if (closed(self, self->ev_n, self->codes[slot].out + t, slot, self->codes[slot].enter_code, 0) < 0) return fail(self);
    if (!self->explicit_steps) {
        uint64_t seq = self->seq + 1;
        set_seq(self, seq);
        int rc = end_step(self, t);
        self->seq = seq + 1;
        set_seq(self, seq + 1);
        if (rc < 0) return fail(self);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_exit_step(Core *self, PyObject *arg) {
    long slot;
    if (!parse_slot(arg, &slot)) return NULL;
    return do_exit_step(self, slot);
}

/* torch's optimizer step hooks, (optimizer, args, kwargs): no Python frame between torch and the record */
static PyObject *Core_opt_pre_hook(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    return do_enter(self, self->opt_slot, 0.0);
}

static PyObject *Core_opt_post_hook(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *r = do_exit_step(self, self->opt_slot);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    if (self->after_step != NULL && self->after_step != Py_None) {
        PyObject *cb = self->after_step;
        Py_INCREF(cb);
        PyObject *x = PyObject_CallNoArgs(cb);
        Py_DECREF(cb);
        if (x == NULL) return fail(self);
        Py_DECREF(x);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_end_step(Core *self, PyObject *arg) {
    uint64_t now = PyLong_AsUnsignedLongLongMask(arg);
    if (now == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (!self->bound) Py_RETURN_NONE;
    if (end_step(self, now) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_write_cp(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_write_cp(base, n, at)");
        return NULL;
    }
    Py_ssize_t base = PyLong_AsSsize_t(args[0]);
    uint64_t n = PyLong_AsUnsignedLongLongMask(args[1]);
    uint64_t at = PyLong_AsUnsignedLongLongMask(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (!self->bound || base < 0 || base + 6 + (Py_ssize_t)self->max_stack > self->nwords) {
        PyErr_SetString(PyExc_IndexError, "checkpoint outside the record");
        return NULL;
    }
    if (write_cp(self, base, n, at) < 0) return NULL;
    Py_RETURN_NONE;
}

/* _bind(buffer, layout: dict) — the record's mapping and its layout, from record.py */
static int get_u64(PyObject *d, const char *key, uint64_t *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "layout: %s", key);
        return 0;
    }
    *out = PyLong_AsUnsignedLongLongMask(v);
    return !PyErr_Occurred();
}

static PyObject *Core_bind(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_bind(buffer, layout)");
        return NULL;
    }
    PyObject *d = args[1];
    uint64_t v[23];
    static const char *keys[23] = {"seq", "events", "ev_count", "steps_done", "ring", "input_slots", "event_mask",
                                   "ring_slots", "entry_words", "entry_cp", "max_stack", "max_phases", "ns_bits",
                                   "gpu_slots", "collective_slot", "optimizer_slot", "origin", "ev_enter",
                                   "ev_exit", "ev_exit_fail", "ev_exit_batch", "ev_split", "ev_coll_exit"};
    for (int i = 0; i < 23; i++)
        if (!get_u64(d, keys[i], &v[i])) return NULL;
    if (v[11] > N_SLOTS || v[12] >= 64) {
        PyErr_SetString(PyExc_ValueError, "layout out of range");
        return NULL;
    }
    uint64_t pv[6];
    static const char *p2p_keys[6] = {"p2p_last", "p2p_known_n", "p2p_known", "p2p_slots", "p2p_seq_bits",
                                      "p2p_unknown"};
    for (int i = 0; i < 6; i++)
        if (!get_u64(d, p2p_keys[i], &pv[i])) return NULL;
    if (pv[3] > P2P_CAP || pv[4] == 0 || pv[4] >= 62 || pv[5] == 0 || pv[4] + (64 - __builtin_clzll(pv[5])) > 62) {
        PyErr_SetString(PyExc_ValueError, "p2p layout out of range");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) return NULL;
    Py_ssize_t nwords = view.len / 8;
    uint64_t need = v[4] + v[7] * v[8];
    if (v[1] + v[6] + 1 > (uint64_t)nwords || need > (uint64_t)nwords || v[5] + 64 > (uint64_t)nwords ||
        pv[0] >= (uint64_t)nwords || pv[1] >= (uint64_t)nwords || pv[2] + pv[3] > (uint64_t)nwords ||
        ((uintptr_t)view.buf & 7)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "record smaller than its layout");
        return NULL;
    }
    if (self->bound) PyBuffer_Release(&self->view);
    self->view = view;
    self->q = (uint64_t *)view.buf;
    self->nwords = nwords;
    self->w_seq = (Py_ssize_t)v[0];
    self->w_ev = (Py_ssize_t)v[1];
    self->w_ev_count = (Py_ssize_t)v[2];
    self->w_steps_done = (Py_ssize_t)v[3];
    self->w_ring = (Py_ssize_t)v[4];
    self->w_input = (Py_ssize_t)v[5];
    self->ev_mask = v[6];
    self->ring_slots = v[7];
    self->entry_words = v[8];
    self->e_cp = v[9];
    self->max_stack = v[10];
    self->max_phases = v[11];
    self->ns_bits = v[12];
    self->gpu_slots = v[13];
    self->gpu_on = self->gpu != NULL && self->gpu != Py_None ? self->gpu_slots : 0;
    self->coll_slot = (int)v[14];
    self->opt_slot = (int)v[15];
    self->origin = v[16];
    self->w_p2p_last = (Py_ssize_t)pv[0];
    self->w_p2p_known_n = (Py_ssize_t)pv[1];
    self->w_p2p_known = (Py_ssize_t)pv[2];
    self->p2p_slots = pv[3];
    self->p2p_seq_bits = pv[4];
    self->p2p_unknown = pv[5];
    uint64_t o = v[16], nb = v[12], en = v[17], ex = v[18], fl = v[19], ba = v[20], sp = v[21], ce = v[22]; /* a collective's enter word comes from its op (_op_word) */
#define CODE(kind, arg) ((((uint64_t)(kind) << 5) | ((uint64_t)(arg) & 31)) << nb)
    for (int s = 0; s < N_SLOTS; s++) {
        self->codes[s].in = CODE(en, s) - o;
        self->codes[s].out = CODE(ex, s) - o;
        self->codes[s].fail = CODE(fl, s) - o;
        self->codes[s].batch = CODE(ba, s) - o;
        self->codes[s].split = CODE(sp, s) - o;
        self->codes[s].enter_code = (en << 5) | (uint64_t)s;
    }
    self->k_coll_in = CODE(en, self->coll_slot) - o;
    self->k_coll_out = CODE(ce, 0) - o;
#undef CODE
    /* the peers already on record (a tracker bound to a record again) */
    self->p2p_n = self->q[self->w_p2p_known_n];
    for (uint64_t i = 0; i < self->p2p_n && i < self->p2p_slots; i++)
        self->p2p_known[i] = self->q[self->w_p2p_known + (Py_ssize_t)i];
    self->bound = 1;
    Py_RETURN_NONE;
}


/* -- Phase: a wrapper around a training function, in C ------------------------------------------------
 * instrument.py's wrappers (DataLoader __next__, a plain phase, a Python-level collective) as one C call
 * around the original: no Python frame of the hook's between the caller and the training work. Same
 * rules as the Python wrappers there (the fallback): enter, call, exit (failing when an exception left,
 * a normal end for StopIteration out of __next__; the collective's exit in any case). Binds like a
 * function when set on a class (a method descriptor), so ``next(it)`` passes the iterator. */

enum { PHASE_PLAIN = 0, PHASE_NEXT = 1, PHASE_COLL = 2, PHASE_BACKWARD = 3, PHASE_OUTERMOST = 4, PHASE_P2P = 5 };

static PyTypeObject *CoreType;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *core, *fn, *arg, *dict;
    int kind;
    long slot;
    int op_known; /* a collective's word, once its op was declared (a core's op words never change) */
    uint64_t op_k;
    int gated;    /* a phase only when called with accumulate_grad=True (torch's engine entry: backward, not grad) */
} Phase;

/* A call's arguments as they came: a vector (vectorcall), or a tuple and a dict (tp_call: the wrapper of a
 * C function that takes a tuple and a dict has no vectorcall, so they reach that function as they are,
 * with no vector made from them and no tuple and dict made back and freed under the wrapper). */
typedef struct {
    PyObject *const *v;
    size_t nargsf;
    PyObject *kwnames;
    PyObject *tuple, *dict; /* tuple != NULL: this form */
} Args;

static inline PyObject *call_fn(Phase *self, const Args *a) {
    if (a->tuple != NULL) return PyObject_Call(self->fn, a->tuple, a->dict);
    return PyObject_Vectorcall(self->fn, a->v, a->nargsf, a->kwnames);
}

/* the first positional argument (borrowed), NULL: none */
static inline PyObject *first_arg(const Args *a) {
    if (a->tuple != NULL) return PyTuple_GET_SIZE(a->tuple) ? PyTuple_GET_ITEM(a->tuple, 0) : NULL;
    return PyVectorcall_NARGS(a->nargsf) ? a->v[0] : NULL;
}


/* -- PhaseState: what a wrapper keeps between calls ---------------------------------------------------
 * The base class of instrument.OutermostForward (``depth``, the nesting shared with its module hooks) and
 * of ddp_timing.DDPTiming (the backward split: ``depth``, ``ready_ns``, ``waiting`` ...): C fields, so the
 * C wrappers and the engine callback read and write them without attribute lookups. The Python classes
 * set every field in their __init__ (the defaults have one copy, there). */

typedef struct {
    PyObject_HEAD
    long long depth, split_count;
    unsigned long long ready_ns;
    long grad_sync_slot;
    char waiting, enabled;
    PyObject *error;
} PhaseState;

static PyTypeObject *PhaseStateType;

/* DDPTiming._stamp: the engine callback at the end of the backward graph (any thread, the GIL held):
 * one store, the clock of time.monotonic_ns */
static PyObject *PhaseState_stamp(PhaseState *self, PyObject *Py_UNUSED(ignored)) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    self->ready_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    Py_RETURN_NONE;
}

/* -- GradReady: DDP timing's post-accumulate-grad hook (ddp_timing._py_grad_ready's rules) ------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *state, *ref, *queue, *stamp;
} GradReady;

static PyObject *GradReady_vectorcall(GradReady *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PhaseState *t = (PhaseState *)self->state;
    /* only the outermost backward, once, and only when DDP's forward prepared this backward's all-reduce */
    if (!t->waiting || t->depth != 1) Py_RETURN_NONE;
    PyObject *ddp = PyWeakref_GET_OBJECT(self->ref); /* borrowed; None once the model is gone (a checked ref) */
    int go = 0;
    if (ddp != Py_None) {
        Py_INCREF(ddp);
        PyObject *v = PyObject_GetAttr(ddp, s_require_sync);
        Py_DECREF(ddp);
        if (v == NULL) goto error;
        go = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (go < 0) goto error;
    }
    if (go) {
        t->waiting = 0;
        PyObject *r = PyObject_CallOneArg(self->queue, self->stamp);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
error: /* kept for end() on the training thread to report; a BaseException goes on */
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (exc != NULL && tb != NULL) PyException_SetTraceback(exc, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        Py_XSETREF(t->error, exc ? exc : Py_NewRef(Py_None));
    }
    Py_RETURN_NONE;
}

static PyObject *GradReady_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *state, *ref, *queue;
    if (!PyArg_ParseTuple(args, "OOO:GradReady", &state, &ref, &queue)) return NULL;
    if (!PyObject_TypeCheck(state, PhaseStateType) || !PyWeakref_CheckRef(ref) || !PyCallable_Check(queue)) {
        PyErr_SetString(PyExc_TypeError, "GradReady(state: PhaseState, ref: weakref, queue: callable)");
        return NULL;
    }
    PyObject *stamp = PyObject_GetAttr(state, s_stamp);
    if (stamp == NULL) return NULL;
    GradReady *self = (GradReady *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(stamp);
        return NULL;
    }
    self->vectorcall = (vectorcallfunc)GradReady_vectorcall;
    self->state = Py_NewRef(state);
    self->ref = Py_NewRef(ref);
    self->queue = Py_NewRef(queue);
    self->stamp = stamp;
    return (PyObject *)self;
}

static int GradReady_traverse(GradReady *self, visitproc visit, void *arg) {
    Py_VISIT(self->state);
    Py_VISIT(self->ref);
    Py_VISIT(self->queue);
    Py_VISIT(self->stamp);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int GradReady_clear(GradReady *self) {
    Py_CLEAR(self->state);
    Py_CLEAR(self->ref);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->stamp);
    return 0;
}

static void GradReady_dealloc(GradReady *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GradReady_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef GradReady_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(GradReady, vectorcall), READONLY, NULL},
    {NULL},
};

static PyType_Slot GradReady_slots[] = {
    {Py_tp_new, GradReady_new},
    {Py_tp_dealloc, GradReady_dealloc},
    {Py_tp_traverse, GradReady_traverse},
    {Py_tp_clear, GradReady_clear},
    {Py_tp_members, GradReady_members},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_doc, "DDP timing's post-accumulate-grad hook (ddp_timing._py_grad_ready, in C)."},
    {0, NULL},
};

static PyType_Spec GradReady_spec = {
    "rankwatch.hooks._fastpath.GradReady",
    sizeof(GradReady),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    GradReady_slots,
};

/* -- backward with DDP's split (instrument._wrap_backward's rules; DDPTiming holds the state) ---------- */

/* DDPTiming.end() (the split time, 0: none) */
static uint64_t timing_end(PyObject *timing, int *ok) {
    PyObject *v = PyObject_CallMethod(timing, "end", NULL);
    if (v == NULL) {
        *ok = 0;
        return 0;
    }
    uint64_t r = PyLong_AsUnsignedLongLongMask(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) *ok = 0;
    return r;
}

static PyObject *backward_call(Phase *self, const Args *a) {
    Core *c = (Core *)self->core;
    PhaseState *t = (PhaseState *)self->arg;
    PyObject *x;
    if (!c->bound || thread_ident() != c->thread_id) /* another thread's backward */
        return call_fn(self, a);
    long long depth = ++t->depth; /* DDPTiming.begin() */
    if (depth == 1) {
        t->ready_ns = 0;
        t->waiting = t->enabled;
    }
    if ((x = do_enter(c, self->slot, 0.0)) == NULL) return NULL;
    Py_DECREF(x);
    PyObject *r = call_fn(self, a);
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (r == NULL) PyErr_Fetch(&et, &ev, &tb);
    long gss = t->grad_sync_slot;
    uint64_t split = 0;
    int ok = 1;
    /* failing, nested, or an error on an autograd thread: end() (it reports the error) */
    if (r == NULL || depth != 1 || (t->error != NULL && t->error != Py_None)) {
        split = timing_end((PyObject *)t, &ok);
    } else { /* DDPTiming.end()'s common path: the outermost backward */
        t->depth = 0;
        t->waiting = 0;
        uint64_t ready = t->ready_ns;
        if (ready && t->enabled) {
            t->ready_ns = 0;
            t->split_count++;
            split = ready;
        }
    }
    if (!ok) {
        split = 0;
        Py_XDECREF(fail(c)); /* clears end()'s error, disables the tracker */
    }
    x = do_exit(c, self->slot, split, split ? gss : -1, r == NULL);
    if (x == NULL) {
        Py_XDECREF(r);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(x);
    if (r == NULL) PyErr_Restore(et, ev, tb);
    return r;
}

/* the outermost call only (instrument.OutermostForward: ``depth`` counts the nesting, shared with its
 * module hooks): DistributedDataParallel.forward as ``forward`` */
static PyObject *outermost_call(Phase *self, const Args *a) {
    Core *c = (Core *)self->core;
    PhaseState *t = (PhaseState *)self->arg;
    PyObject *x;
    long long depth = ++t->depth;
    if (depth == 1) {
        if ((x = do_enter(c, self->slot, 0.0)) == NULL) return NULL;
        Py_DECREF(x);
    }
    PyObject *r = call_fn(self, a);
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (r == NULL) PyErr_Fetch(&et, &ev, &tb);
    t->depth = depth - 1;
    if (depth == 1) {
        x = do_exit(c, self->slot, 0, -1, r == NULL);
        if (x == NULL) {
            Py_XDECREF(r);
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_DECREF(x);
    }
    if (r == NULL) PyErr_Restore(et, ev, tb);
    return r;
}

/* the keyword ``accumulate_grad`` given as True (torch.autograd.backward's call of the engine; grad's is False) */
static int accumulates(const Args *a) {
    if (a->tuple != NULL) {
        if (a->dict == NULL) return 0;
        PyObject *v = PyDict_GetItemWithError(a->dict, s_gate_kw); /* borrowed; an error reads as "no" */
        if (v == NULL) PyErr_Clear();
        return v == Py_True;
    }
    if (a->kwnames == NULL) return 0;
    Py_ssize_t nargs = PyVectorcall_NARGS(a->nargsf), nkw = PyTuple_GET_SIZE(a->kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GET_ITEM(a->kwnames, i);
        if (k == s_gate_kw || (PyUnicode_Check(k) && PyUnicode_Compare(k, s_gate_kw) == 0))
            return a->v[nargs + i] == Py_True;
    }
    return 0;
}

/* a send's ``dst`` / a recv's ``src``: the second positional argument or that keyword, when it is an int (a
 * global rank); -1 otherwise (None: any source; only ``group_dst``/``group_src`` given: a group's rank). Never
 * raises. */
static long long p2p_peer_arg(const Args *a, PyObject *kw) {
    PyObject *v = NULL;
    if (a->tuple != NULL) {
        if (PyTuple_GET_SIZE(a->tuple) > 1) {
            v = PyTuple_GET_ITEM(a->tuple, 1);
        } else if (a->dict != NULL) {
            v = PyDict_GetItemWithError(a->dict, kw); /* borrowed */
            if (v == NULL) PyErr_Clear();
        }
    } else {
        Py_ssize_t nargs = PyVectorcall_NARGS(a->nargsf);
        if (nargs > 1) {
            v = a->v[1];
        } else if (a->kwnames != NULL) {
            Py_ssize_t nkw = PyTuple_GET_SIZE(a->kwnames);
            for (Py_ssize_t i = 0; i < nkw && v == NULL; i++) {
                PyObject *k = PyTuple_GET_ITEM(a->kwnames, i);
                if (k == kw || (PyUnicode_Check(k) && PyUnicode_Compare(k, kw) == 0)) v = a->v[nargs + i];
            }
        }
    }
    return v == NULL ? -1 : peer_of(v);
}

static PyObject *phase_call(Phase *self, const Args *a) {
    if (self->gated && !accumulates(a)) return call_fn(self, a);
    if (self->kind == PHASE_BACKWARD) return backward_call(self, a);
    if (self->kind == PHASE_OUTERMOST) return outermost_call(self, a);
    Core *c = (Core *)self->core;
    PyObject *x;
    int coll = self->kind == PHASE_COLL || self->kind == PHASE_P2P;
    long long peer = -1;
    if (self->kind == PHASE_P2P && on_thread(c)) {
        peer = p2p_peer_arg(a, self->slot == 1 ? s_dst : s_src);
        p2p_enter(c, peer, self->slot);
    }
    if (coll) {
        x = collective_enter(c, self->arg, &self->op_k, &self->op_known);
    } else {
        x = do_enter(c, self->slot, 0.0);
    }
    if (x == NULL) return NULL;
    Py_DECREF(x);
    PyObject *r = call_fn(self, a);
    if (r != NULL) {
        if (coll) {
            x = Core_collective_exit(c, NULL);
            if (self->kind == PHASE_P2P && x != NULL && on_thread(c)) p2p_learn(c, peer); /* exchanged with it */
        } else if (self->kind == PHASE_NEXT) {
            PyObject *it = first_arg(a);
            int mine = it != NULL && self->arg != Py_None && (PyObject *)Py_TYPE(it) == self->arg;
            x = do_exit_batch(c, self->slot, mine);
        } else {
            x = do_exit(c, self->slot, 0, -1, 0);
        }
        if (x == NULL) {
            Py_DECREF(r);
            return NULL;
        }
        Py_DECREF(x);
        return r;
    }
    /* an exception leaves the phase: a failing exit, except the end of an epoch (StopIteration out of
     * __next__) and a collective (whose exit is the same either way) */
    int failing = !(self->kind == PHASE_NEXT && PyErr_ExceptionMatches(PyExc_StopIteration));
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (coll) {
        x = Core_collective_exit(c, NULL);
    } else {
        x = do_exit(c, self->slot, 0, -1, failing);
    }
    if (x == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(x);
    PyErr_Restore(et, ev, tb); /* the training function's exception goes on (one of the exit's would win) */
    return NULL;
}

static PyObject *Phase_vectorcall(Phase *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Args a = {args, nargsf, kwnames, NULL, NULL};
    return phase_call(self, &a);
}

static PyObject *Phase_call(Phase *self, PyObject *args, PyObject *kwargs) {
    Args a = {NULL, 0, NULL, args, kwargs};
    return phase_call(self, &a);
}

static PyObject *Phase_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *core, *fn, *arg;
    int kind, gated = 0;
    long slot;
    if (!PyArg_ParseTuple(args, "OOilO|p:Phase", &core, &fn, &kind, &slot, &arg, &gated)) return NULL;
    if (!PyObject_TypeCheck(core, CoreType) || !PyCallable_Check(fn) || kind < PHASE_PLAIN || kind > PHASE_P2P ||
        ((kind == PHASE_COLL || kind == PHASE_P2P) && !PyUnicode_Check(arg)) ||
        (kind == PHASE_P2P && slot != 1 && slot != 2) ||
        ((kind == PHASE_BACKWARD || kind == PHASE_OUTERMOST) && !PyObject_TypeCheck(arg, PhaseStateType))) {
        PyErr_SetString(PyExc_TypeError, "Phase(core: Core, fn: callable, kind: 0-5, slot: int, arg, gated: bool = False)");
        return NULL;
    }
    Phase *self = (Phase *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    /* a C function taking a tuple (and a dict) is called with the caller's own (Phase_call, Args) */
    int tuple_fn = PyCFunction_Check(fn) && (PyCFunction_GET_FLAGS(fn) & METH_VARARGS) &&
                   !(PyCFunction_GET_FLAGS(fn) & METH_FASTCALL);
    self->vectorcall = tuple_fn ? NULL : (vectorcallfunc)Phase_vectorcall;
    self->core = Py_NewRef(core);
    self->fn = Py_NewRef(fn);
    self->arg = Py_NewRef(arg);
    self->kind = kind;
    self->slot = slot;
    self->gated = gated;
    return (PyObject *)self;
}

static PyObject *Phase_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int Phase_traverse(Phase *self, visitproc visit, void *arg) {
    Py_VISIT(self->core);
    Py_VISIT(self->fn);
    Py_VISIT(self->arg);
    Py_VISIT(self->dict);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int Phase_clear(Phase *self) {
    Py_CLEAR(self->core);
    Py_CLEAR(self->fn);
    Py_CLEAR(self->arg);
    Py_CLEAR(self->dict);
    return 0;
}

static void Phase_dealloc(Phase *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Phase_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef Phase_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Phase, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Phase, vectorcall), READONLY, NULL},
    {"_fn", T_OBJECT, offsetof(Phase, fn), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Phase_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyType_Slot Phase_slots[] = {
    {Py_tp_getset, Phase_getset},
    {Py_tp_new, Phase_new},
    {Py_tp_dealloc, Phase_dealloc},
    {Py_tp_traverse, Phase_traverse},
    {Py_tp_clear, Phase_clear},
    {Py_tp_members, Phase_members},
    {Py_tp_call, Phase_call},
    {Py_tp_descr_get, Phase_get},
    {Py_tp_doc, "A training function wrapped as a phase (instrument.py's wrappers, in C)."},
    {0, NULL},
};

static PyType_Spec Phase_spec = {
    "rankwatch.hooks._fastpath.Phase",
    sizeof(Phase),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    Phase_slots,
};

static PyObject *PhaseState_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PhaseState *self = (PhaseState *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->grad_sync_slot = -1;
    self->error = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static int PhaseState_traverse(PhaseState *self, visitproc visit, void *arg) {
    Py_VISIT(self->error);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int PhaseState_clear(PhaseState *self) {
    Py_CLEAR(self->error);
    return 0;
}

static void PhaseState_dealloc(PhaseState *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    PhaseState_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

#define M(name, type, field) {name, type, offsetof(PhaseState, field), 0, NULL}
static PyMemberDef PhaseState_members[] = {
    M("depth", T_LONGLONG, depth),
    M("split_count", T_LONGLONG, split_count),
    M("ready_ns", T_ULONGLONG, ready_ns),
    M("grad_sync_slot", T_LONG, grad_sync_slot),
    M("waiting", T_BOOL, waiting),
    M("enabled", T_BOOL, enabled),
    M("_error", T_OBJECT, error),
    {NULL},
};
#undef M

static PyMethodDef PhaseState_methods[] = {
    {"_stamp", (PyCFunction)PhaseState_stamp, METH_NOARGS, NULL},
    {NULL},
};

static PyType_Slot PhaseState_slots[] = {
    {Py_tp_new, PhaseState_new},
    {Py_tp_dealloc, PhaseState_dealloc},
    {Py_tp_traverse, PhaseState_traverse},
    {Py_tp_clear, PhaseState_clear},
    {Py_tp_members, PhaseState_members},
    {Py_tp_methods, PhaseState_methods},
    {Py_tp_doc, "What a wrapper keeps between calls, as C fields (OutermostForward's and DDPTiming's base)."},
    {0, NULL},
};

static PyType_Spec PhaseState_spec = {
    "rankwatch.hooks._fastpath.PhaseState",
    sizeof(PhaseState),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    PhaseState_slots,
};

/* -- type plumbing ---------------------------------------------------------------------------------------- */

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Core *self = (Core *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->tid = -1;
    self->stk = self->stk0;
    self->cap = STK0;
    self->budgets = PyList_New(0);
    self->ops = PyDict_New();
    self->gpu = Py_NewRef(Py_None);
    self->frozen = Py_NewRef(Py_None);
    self->clock = Py_NewRef(Py_None);
    self->after_step = Py_NewRef(Py_None);
    if (!self->budgets || !self->ops) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int Core_traverse(Core *self, visitproc visit, void *arg) {
    Py_VISIT(self->budgets);
    Py_VISIT(self->gpu);
    Py_VISIT(self->ops);
    Py_VISIT(self->frozen);
    Py_VISIT(self->clock);
    Py_VISIT(self->after_step);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int Core_clear(Core *self) {
    Py_CLEAR(self->budgets);
    Py_CLEAR(self->gpu);
    Py_CLEAR(self->ops);
    Py_CLEAR(self->frozen);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->after_step);
    return 0;
}

static void Core_dealloc(Core *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Core_clear(self);
    if (self->bound) {
        self->bound = 0;
        PyBuffer_Release(&self->view);
    }
    if (self->stk != self->stk0) PyMem_Free(self->stk);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Core_release(Core *self, PyObject *Py_UNUSED(ignored)) {
    /* let the record's mapping be closed: nothing is written after this */
    if (self->bound) {
        self->bound = 0;
        self->tid = -1;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

#define M(name, type, field) {name, type, offsetof(Core, field), 0, NULL}
static PyMemberDef Core_members[] = {
    M("_tid", T_LONGLONG, tid),
    M("thread_id", T_LONGLONG, thread_id),
    M("_ev_n", T_ULONGLONG, ev_n),
    M("_slow_at", T_ULONGLONG, slow_at),
    M("_seq", T_ULONGLONG, seq),
    M("_steps_done", T_ULONGLONG, steps_done),
    M("_step_start", T_ULONGLONG, step_start),
    M("_seen_ns", T_ULONGLONG, seen_ns),
    M("_seen_batches", T_ULONGLONG, seen_batches),
    M("_origin", T_ULONGLONG, origin),
    M("_colls", T_LONGLONG, colls),
    M("_p2p_n", T_ULONGLONG, p2p_n),
    M("input_slots_used", T_LONGLONG, input_slots_used),
    M("input_workers", T_LONGLONG, input_workers),
    M("explicit_steps", T_BOOL, explicit_steps),
    M("_ops", T_OBJECT_EX, ops),
    M("_frozen", T_OBJECT, frozen),
    M("_after_step", T_OBJECT, after_step),
    {NULL},
};
#undef M

/* the C-held state as the Python slow paths see it (tracker.Tracker, like PyCore's attributes) */
static PyObject *Core_get_stack(Core *self, void *Py_UNUSED(c)) {
    PyObject *l = PyList_New(self->depth);
    if (l == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->depth; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(self->stk[i]);
        if (v == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, v);
    }
    return l;
}

static int Core_set_stack(Core *self, PyObject *v, void *Py_UNUSED(c)) {
    if (v == NULL || !PyList_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "_stack must be a list of ints");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(v);
    if (n > self->cap && grow(self, n) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(v, i));
        if (w == (uint64_t)-1 && PyErr_Occurred()) return -1;
        self->stk[i] = w;
    }
    self->depth = n;
    return 0;
}

static PyObject *Core_get_budgets(Core *self, void *Py_UNUSED(c)) { return Py_NewRef(self->budgets); }

static int Core_set_budgets(Core *self, PyObject *v, void *Py_UNUSED(c)) {
    if (v == NULL) {
        PyErr_SetString(PyExc_TypeError, "_budgets cannot be deleted");
        return -1;
    }
    Py_SETREF(self->budgets, Py_NewRef(v));
    refresh_budgets(self);
    return 0;
}

static PyObject *Core_get_last_op(Core *self, void *Py_UNUSED(c)) {
    return self->has_last_op ? PyLong_FromUnsignedLongLong(self->last_op) : PyLong_FromLong(-1);
}

static int Core_set_last_op(Core *self, PyObject *v, void *Py_UNUSED(c)) {
    if (v == NULL || !PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "_last_op must be an int");
        return -1;
    }
    int overflow = 0;
    long long sv = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (sv == -1 && !overflow && PyErr_Occurred()) return -1;
    int neg = overflow < 0 || (overflow == 0 && sv < 0);
    uint64_t k = neg ? 0 : PyLong_AsUnsignedLongLongMask(v);
    if (k == (uint64_t)-1 && PyErr_Occurred()) return -1;
    self->has_last_op = !neg;
    self->last_op = k;
    return 0;
}

static PyObject *Core_get_gpu(Core *self, void *Py_UNUSED(c)) { return Py_NewRef(self->gpu); }

static int Core_set_gpu(Core *self, PyObject *v, void *Py_UNUSED(c)) {
    Py_XSETREF(self->gpu, Py_NewRef(v != NULL ? v : Py_None));
    self->gpu_on = self->gpu != Py_None ? self->gpu_slots : 0;
    return 0;
}

static PyObject *Core_get_clock(Core *self, void *Py_UNUSED(c)) { return Py_NewRef(self->clock); }

static int Core_set_clock(Core *self, PyObject *v, void *Py_UNUSED(c)) {
    Py_XSETREF(self->clock, Py_NewRef(v != NULL ? v : Py_None));
    self->py_clock = self->clock != Py_None;
    return 0;
}

static PyGetSetDef Core_getset[] = {
    {"_stack", (getter)Core_get_stack, (setter)Core_set_stack, "open phases (a copy: assign to change)", NULL},
    {"_budgets", (getter)Core_get_budgets, (setter)Core_set_budgets, NULL, NULL},
    {"_last_op", (getter)Core_get_last_op, (setter)Core_set_last_op, NULL, NULL},
    {"_clock", (getter)Core_get_clock, (setter)Core_set_clock, NULL, NULL},
    {"_gpu", (getter)Core_get_gpu, (setter)Core_set_gpu, NULL, NULL},
    {NULL},
};

static PyMethodDef Core_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))Core_enter, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"exit", (PyCFunction)(void (*)(void))Core_exit, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"exit_batch", (PyCFunction)(void (*)(void))Core_exit_batch, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"exit_step", (PyCFunction)Core_exit_step, METH_O, NULL},
    {"collective_enter", (PyCFunction)Core_collective_enter, METH_O, NULL},
    {"collective_exit", (PyCFunction)Core_collective_exit, METH_NOARGS, NULL},
    {"p2p_enter", (PyCFunction)(void (*)(void))Core_p2p_enter, METH_FASTCALL, NULL},
    {"p2p_learn", (PyCFunction)Core_p2p_learn, METH_O, NULL},
    {"opt_pre_hook", (PyCFunction)(void (*)(void))Core_opt_pre_hook, METH_FASTCALL, NULL},
    {"opt_post_hook", (PyCFunction)(void (*)(void))Core_opt_post_hook, METH_FASTCALL, NULL},
    {"_end_step", (PyCFunction)Core_end_step, METH_O, NULL},
    {"_write_cp", (PyCFunction)(void (*)(void))Core_write_cp, METH_FASTCALL, NULL},
    {"_bind", (PyCFunction)(void (*)(void))Core_bind, METH_FASTCALL, NULL},
    {"_release", (PyCFunction)Core_release, METH_NOARGS, NULL},
    {NULL},
};

static PyType_Slot Core_slots[] = {
    {Py_tp_new, Core_new},
    {Py_tp_dealloc, Core_dealloc},
    {Py_tp_traverse, Core_traverse},
    {Py_tp_clear, Core_clear},
    {Py_tp_members, Core_members},
    {Py_tp_getset, Core_getset},
    {Py_tp_methods, Core_methods},
    {Py_tp_doc, "The tracker's hot paths (see tracker.PyCore for the same in Python)."},
    {0, NULL},
};

static PyType_Spec Core_spec = {
    "rankwatch.hooks._fastpath.Core",
    sizeof(Core),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    Core_slots,
};

static int exec_module(PyObject *m) {
#define INTERN(var, s) \
    if ((var = PyUnicode_InternFromString(s)) == NULL) return -1;
    INTERN(s_entered_slow, "_entered_slow");
    INTERN(s_exited_slow, "_exited_slow");
    INTERN(s_fail, "_fail");
    INTERN(s_op_word, "_op_word");
    INTERN(s_harvest_gpu, "_harvest_gpu");
    INTERN(s_require_sync, "require_forward_param_sync");
    INTERN(s_stamp, "_stamp");
    INTERN(s_gate_kw, "accumulate_grad");
    INTERN(s_dst, "dst");
    INTERN(s_src, "src");
#undef INTERN
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__))
    tp_is_ident = (unsigned long)(uintptr_t)__builtin_thread_pointer() == PyThread_get_thread_ident();
#endif
    PyObject *t = PyType_FromModuleAndSpec(m, &Core_spec, NULL);
    if (t == NULL) return -1;
    CoreType = (PyTypeObject *)t;
    Py_INCREF(t); /* CoreType: for the life of the process */
    if (PyModule_AddObject(m, "Core", t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "PHASE_PLAIN", PHASE_PLAIN) < 0 ||
        PyModule_AddIntConstant(m, "PHASE_NEXT", PHASE_NEXT) < 0 ||
        PyModule_AddIntConstant(m, "PHASE_COLL", PHASE_COLL) < 0 ||
        PyModule_AddIntConstant(m, "PHASE_BACKWARD", PHASE_BACKWARD) < 0 ||
        PyModule_AddIntConstant(m, "PHASE_OUTERMOST", PHASE_OUTERMOST) < 0 ||
        PyModule_AddIntConstant(m, "PHASE_P2P", PHASE_P2P) < 0)
        return -1;
    PyObject *st = PyType_FromModuleAndSpec(m, &PhaseState_spec, NULL);
    if (st == NULL) return -1;
    PhaseStateType = (PyTypeObject *)st;
    Py_INCREF(st); /* PhaseStateType: for the life of the process */
    if (PyModule_AddObject(m, "PhaseState", st) < 0) {
        Py_DECREF(st);
        return -1;
    }
    PyObject *g = PyType_FromModuleAndSpec(m, &GradReady_spec, NULL);
    if (g == NULL) return -1;
    if (PyModule_AddObject(m, "GradReady", g) < 0) {
        Py_DECREF(g);
        return -1;
    }
    PyObject *p = PyType_FromModuleAndSpec(m, &Phase_spec, NULL);
    if (p == NULL) return -1;
    if (PyModule_AddObject(m, "Phase", p) < 0) {
        Py_DECREF(p);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastpath", "The tracker's hot paths in C.", 0, NULL, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModuleDef_Init(&module); }
