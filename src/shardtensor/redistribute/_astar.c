/* Native redistribution planner of shardtensor.redistribute.optimal: the A* search and what
 * surrounds it (spec encoding and validation, the zero-cost shortcut, building the Steps).
 *
 * A port of optimal._search_python, the reference: same state encoding, edge costs, admissible
 * bound, prunings and heap order, so it returns the same steps and the same counters (the tests
 * compare the two on thousands of random pairs).  The model is explained in optimal.py's
 * docstring; this file explains only what C adds.  plan() answers None for anything it does not
 * handle (integers too wide, invalid specs, unusual argument types), and optimal.py then runs the
 * Python planner, which also raises the errors.
 *
 * Numbers.  Python's combined costs are unbounded ints ``bandwidth << shift | latency``; here
 * they are signed __int128.  mesh_setup() checks once that every edge cost and every bound term
 * is below 2^124, and the search checks that no path cost exceeds 2^125, so no sum overflows
 * (f <= g + bound + cycle extra < 2^127).  Volumes (|X| S, Phi, the bound's sums) are int64:
 * mesh_setup() requires |X| S < 2^62.
 *
 * No divisions while searching.  Every division of the bound has the form ``|X| S / K`` (or a
 * floor of a floor of it, which is the same number: floor(floor(a/b)/c) = floor(a/(bc))), where
 * K is the product of the sizes of a set of mesh dims; |X| S is a multiple of every such K (S is
 * a multiple of the product of all mesh sizes).  So D[mask] = |X| S / prod(mask) is tabled once
 * and the bound's categories (Python's products Kf, KC, KP, KO) are kept as masks.  Likewise the
 * padded piece ceil(L_d / prod(mask)) of tensor dim d under a set of mesh dims is tabled lazily
 * (ceil(ceil(a/b)/c) = ceil(a/(bc)) gives Python's -(-n_b // k) for a push onto b).
 *
 * Ties.  Python's heap holds tuples (f, -g, state, parent, move) and pops the smallest.  No two
 * pushed tuples are equal (a state is pushed again only with a strictly smaller g, or once with
 * a larger f for a waiting cycle), so the pop order is the sorted order of the tuples whatever
 * the heap's shape: comparing the same five fields in the same order gives the same pops, hence
 * the same expansions, the same best-g table and the same path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef __SIZEOF_INT128__
#error "the native planner needs __int128 (gcc or clang); the Python search is used instead"
#endif

typedef __int128 i128;
typedef unsigned __int128 u128;

#define MAXM 8  /* mesh dims */
#define MAXN 16 /* tensor dims (a move packs the tensor dim in 4 bits) */
#define MAXC (2 + MAXN * MAXM)
#define STATE_BITS 47 /* states < 2^47, so (parent + 1) << 16 | move fits 63 bits */
#define EMPTY UINT64_MAX
#define G_LIMIT ((i128)1 << 125)
#define TERM_BITS 124
#define CYC_DONE ((uint64_t)1 << 63)

/* (parent, move) packed so that comparing the packed values compares the pairs (parent >= -1) */
#define PACK(parent, move) (((uint64_t)((parent) + 1) << 16) | (uint64_t)(move))
#define PACK_PARENT(p) ((int64_t)((p) >> 16) - 1)
#define PACK_MOVE(p) ((int32_t)((p)&0xFFFF))

/* ---------------------------------------------------------------------------------------------
 * constants of one search (optimal._mesh_tables and the per-pair tables of optimal._search_python) */
typedef struct {
    int m, N;
    int64_t ks[MAXM];
    uint64_t MASK;
    int SH[MAXM];
    int CD[MAXC], CP[MAXC]; /* code -> tensor dim, list position (codes >= 2) */
    i128 AG[MAXM], AR[MAXM];
    int64_t LAT1[MAXM], LAT2[MAXM];
    i128 hmul;
    int64_t shape[MAXN];
    int TD[MAXM], tS[MAXM], compat[MAXM];
    unsigned tSm, compatm, Nm, tdbit[MAXM]; /* masks: shard targets, compatible partials, tensor dims */
    int T[MAXN][MAXM], TL[MAXN], PK[MAXN][MAXM];
    int twin[MAXN];
    int64_t K_all, XS, PHIEND, AU[MAXM], AU2[MAXM];
    int64_t PW[MAXM][MAXN][2];
    i128 CYW[MAXM];
    int64_t P[1 << MAXM]; /* product of the mesh sizes in a mask */
    int64_t D[1 << MAXM]; /* |X| S / P[mask], exact */
    uint64_t GM, gbase, start;
    int64_t *NT; /* NT[d << m | mask] = ceil(L_d / P[mask]), -1 until first used */
} Ctx;

static inline int64_t piece(const Ctx *c, int d, unsigned mask) {
    int64_t *v = &c->NT[(size_t)d << c->m | mask];
    if (*v < 0)
        *v = (c->shape[d] + c->P[mask] - 1) / c->P[mask];
    return *v;
}

/* ---------------------------------------------------------------------------------------------
 * best-g table (Python's best, prev and cyc_done): open addressing, linear probing.  ``prev``
 * is the packed (parent, move) recorded when the state was last popped, 0 before; its top bit
 * says the waiting cycles of the state were evaluated. */
typedef struct {
    uint64_t *key; /* probed alone: 8 bytes a slot keep the probes in L1 */
    i128 *g;
    uint64_t *prev;
    size_t cap, count;
    int bits;
} Table;

static int table_init(Table *t, int bits) {
    t->bits = bits;
    t->cap = (size_t)1 << bits;
    t->count = 0;
    t->key = (uint64_t *)PyMem_Malloc(t->cap * (2 * sizeof(uint64_t) + sizeof(i128)));
    if (!t->key)
        return -1;
    t->g = (i128 *)(t->key + t->cap); /* 16-byte aligned: cap is a multiple of 2 */
    t->prev = (uint64_t *)(t->g + t->cap);
    memset(t->key, 0xFF, t->cap * sizeof(uint64_t)); /* EMPTY */
    return 0;
}

static void table_free(Table *t) { PyMem_Free(t->key); }

/* the slot holding ``key``, or the empty slot where it would go */
static inline size_t table_find(const Table *t, uint64_t key) {
    size_t mask = t->cap - 1, i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - t->bits));
    while (t->key[i] != key && t->key[i] != EMPTY)
        i = (i + 1) & mask;
    return i;
}

static int table_grow(Table *t) {
    Table n;
    if (table_init(&n, t->bits + 1) < 0)
        return -1;
    for (size_t i = 0; i < t->cap; i++)
        if (t->key[i] != EMPTY) {
            size_t x = table_find(&n, t->key[i]);
            n.key[x] = t->key[i];
            n.g[x] = t->g[i];
            n.prev[x] = t->prev[i];
        }
    n.count = t->count;
    table_free(t);
    *t = n;
    return 0;
}

/* best[s2] = g2 if that lowers it: 1 if it did (the caller pushes), 0 if not, -1 no memory */
static inline int improve(Table *t, uint64_t s2, i128 g2) {
    size_t x = table_find(t, s2);
    if (t->key[x] == s2) {
        if (!(g2 < t->g[x]))
            return 0;
        t->g[x] = g2;
        return 1;
    }
    t->key[x] = s2;
    t->g[x] = g2;
    t->prev[x] = 0;
    if (++t->count * 2 > t->cap && table_grow(t) < 0)
        return -1;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * priority queue of (f, -g, state, (parent, move)), ordered like Python's tuples.  The items
 * stay where they were pushed (an arena); the heap moves 24-byte slots holding f (most
 * comparisons end there) and the item's index.  f >= 0 (g >= 0, and so is every bound term),
 * so comparing its two halves unsigned compares it. */
typedef struct {
    i128 f, ng;
    uint64_t st, pm;
} Item;

typedef struct { /* an item in the arena: its f is in its slot */
    i128 ng;
    uint64_t st, pm;
} Rest;

typedef struct {
    uint64_t fhi, flo;
    uint32_t idx;
} Slot;

typedef struct {
    Rest *items;
    Slot *a;
    size_t n, cap, ni, capi;
} Heap;

static int heap_init(Heap *h, size_t cap) {
    h->n = h->ni = 0;
    h->cap = h->capi = cap;
    h->items = (Rest *)PyMem_Malloc(cap * sizeof(Rest));
    h->a = (Slot *)PyMem_Malloc(cap * sizeof(Slot));
    return h->items && h->a ? 0 : -1;
}

static void heap_free(Heap *h) {
    PyMem_Free(h->items);
    PyMem_Free(h->a);
}

/* x < y when f differs; the rest of the order (rarely needed) is in slot_tie */
static int slot_tie(const Heap *h, const Slot *x, const Slot *y) {
    const Rest *a = &h->items[x->idx], *b = &h->items[y->idx];
    if (a->ng != b->ng)
        return a->ng < b->ng;
    if (a->st != b->st)
        return a->st < b->st;
    return a->pm < b->pm;
}

/* Branch-free on f: which of two slots comes first is data dependent (half the time one way),
 * so a branch there mispredicts often; only equal f (a plateau) takes the tie branch. */
static inline int slot_lt(const Heap *h, const Slot *x, const Slot *y) {
    const int hi_lt = x->fhi < y->fhi, hi_eq = x->fhi == y->fhi;
    const int lt = hi_lt | (hi_eq & (x->flo < y->flo));
    if (__builtin_expect(hi_eq & (x->flo == y->flo), 0))
        return slot_tie(h, x, y);
    return lt;
}

static int heap_push(Heap *h, i128 f, i128 ng, uint64_t st, uint64_t pm) {
    if (h->ni == h->capi) {
        if (h->capi >= UINT32_MAX / 2)
            return -1;
        Rest *a = (Rest *)PyMem_Realloc(h->items, 2 * h->capi * sizeof(Rest));
        if (!a)
            return -1;
        h->items = a;
        h->capi *= 2;
    }
    if (h->n == h->cap) {
        Slot *a = (Slot *)PyMem_Realloc(h->a, 2 * h->cap * sizeof(Slot));
        if (!a)
            return -1;
        h->a = a;
        h->cap *= 2;
    }
    Rest *it = &h->items[h->ni];
    it->ng = ng;
    it->st = st;
    it->pm = pm;
    Slot x = {(uint64_t)((u128)f >> 64), (uint64_t)f, (uint32_t)h->ni++};
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) >> 1;
        if (!slot_lt(h, &x, &h->a[p]))
            break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i] = x;
    return 0;
}

/* Floyd's pop (as Python's heapq): move the hole down to a leaf along the smaller children,
 * then put the last slot there and sift it up (it rarely rises): one comparison a level. */
static Item heap_pop(Heap *h) {
    const Rest *r = &h->items[h->a[0].idx];
    const Item top = {(i128)(((u128)h->a[0].fhi << 64) | h->a[0].flo), r->ng, r->st, r->pm};
    const Slot last = h->a[--h->n];
    size_t i = 0, n = h->n;
    if (!n)
        return top;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n)
            c += (size_t)slot_lt(h, &h->a[c + 1], &h->a[c]);
        h->a[i] = h->a[c];
        i = c;
    }
    while (i > 0) {
        size_t p = (i - 1) >> 1;
        if (!slot_lt(h, &last, &h->a[p]))
            break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i] = last;
    return top;
}

/* ---------------------------------------------------------------------------------------------
 * optimal._cycle_extra: cheapest set of extra moves breaking every waiting cycle */
static i128 cycle_extra(const Ctx *c, unsigned nodem, const int *where) {
    /* nodem: the misplaced shards whose target is a shard on another tensor dim; where[j]: the
     * tensor dim j sits on.  Node i waits for node x when x sits on i's target tensor dim. */
    int nodes[MAXM], nn = 0;
    unsigned on[MAXN];
    for (int d = 0; d < c->N; d++)
        on[d] = 0;
    for (unsigned x = nodem; x; x &= x - 1) {
        const int j = __builtin_ctz(x);
        on[where[j]] |= 1u << nn;
        nodes[nn++] = j;
    }
    if (nn < 2)
        return 0;
    uint32_t succ[MAXM];
    for (int i = 0; i < nn; i++)
        succ[i] = on[c->TD[nodes[i]]] & ~(1u << i);
    /* acyc[S]: the nodes of S form no cycle.  A sink of S (no successor in S) lies on no cycle,
     * so S is acyclic iff it has a sink whose removal leaves it acyclic. */
    const uint32_t full = (1u << nn) - 1;
    uint8_t acyc[1 << MAXM];
    acyc[0] = 1;
    for (uint32_t S = 1; S <= full; S++) {
        int a = 0;
        for (uint32_t y = S; y; y &= y - 1) {
            const int i = __builtin_ctz(y);
            a |= (!(succ[i] & S)) & acyc[S & ~(1u << i)];
        }
        acyc[S] = (uint8_t)a;
    }
    if (acyc[full])
        return 0;
    /* the cheapest set of nodes whose removal leaves no cycle (weights summed over its bits);
     * cut = full always qualifies */
    i128 w[1 << MAXM], best = -1;
    w[0] = 0;
    for (uint32_t cut = 1; cut <= full; cut++) {
        w[cut] = w[cut & (cut - 1)] + c->CYW[nodes[__builtin_ctz(cut)]];
        if (acyc[full & ~cut] && (best < 0 || w[cut] < best))
            best = w[cut];
    }
    return best;
}

/* ---------------------------------------------------------------------------------------------
 * arguments.  Helpers return 0 ok, 1 when the inputs do not fit or are not what optimal.py
 * checked them to be (plan() then returns None: the caller runs the Python planner, which also
 * raises the errors), -1 on a Python error. */
static PyObject *str_dim, *str_reduce_op, *str_sum, *str_avg, *step_fields[5];

static int get_i64(PyObject *o, int64_t *out) {
    int overflow = 0;
    if (!PyLong_Check(o))
        return 1;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow)
        return 1;
    *out = (int64_t)v;
    return 0;
}

/* a tuple of n ints in [lo, hi] */
static int get_ints(PyObject *t, int n, int64_t lo, int64_t hi, int64_t *out) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n)
        return 1;
    for (int i = 0; i < n; i++) {
        int r = get_i64(PyTuple_GET_ITEM(t, i), &out[i]);
        if (r)
            return r;
        if (out[i] < lo || out[i] > hi)
            return 1;
    }
    return 0;
}

static int bit_length(uint64_t v) {
    int b = 0;
    while (v) {
        b++;
        v >>= 1;
    }
    return b;
}

static int fits(u128 v, int bits) { return bits > 0 && bits < 128 && (v >> bits) == 0; }

/* optimal._native_kit(): what building Steps and reading placements needs */
typedef struct {
    PyObject *step, *partial, *repl, *shards, *shard_t, *repl_t;
    int fast;
} Kit;

static int get_kit(PyObject *o, Kit *k) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 7)
        return 1;
    k->step = PyTuple_GET_ITEM(o, 0);
    k->partial = PyTuple_GET_ITEM(o, 2);
    k->repl = PyTuple_GET_ITEM(o, 3);
    k->shards = PyTuple_GET_ITEM(o, 4);
    k->shard_t = PyTuple_GET_ITEM(o, 5);
    k->repl_t = PyTuple_GET_ITEM(o, 6);
    k->fast = PyObject_IsTrue(PyTuple_GET_ITEM(o, 1));
    if (k->fast < 0)
        return -1;
    if (!PyType_Check(k->partial) || !PyType_Check(k->shard_t) || !PyType_Check(k->repl_t) ||
        !PyTuple_Check(k->shards) || PyTuple_GET_SIZE(k->shards) < MAXN)
        return 1;
    if (!PyType_Check(k->step))
        k->fast = 0;
    return 0;
}

/* The constants that depend on the mesh, the links and the shape only (optimal._mesh_tables and
 * the pair-independent part of optimal._search_python's tables). */
static int mesh_setup(Ctx *c, PyObject *const *args) {
    PyObject *oks = args[0], *owb = args[1], *owa = args[2], *oshape = args[4];
    int64_t v64, shift, wb[MAXM], wa[MAXM];
    int r;
    if (!PyTuple_Check(oks) || !PyTuple_Check(oshape))
        return 1;
    c->m = (int)PyTuple_GET_SIZE(oks);
    c->N = (int)PyTuple_GET_SIZE(oshape);
    const int m = c->m, N = c->N;
    if (m < 1 || m > MAXM || N > MAXN)
        return 1;
    if ((r = get_ints(oks, m, 1, (int64_t)1 << 20, c->ks)) || (r = get_ints(owb, m, 0, INT64_MAX, wb)) ||
        (r = get_ints(owa, m, 0, INT64_MAX, wa)) ||
        (r = get_ints(oshape, N, 0, ((int64_t)1 << 62) - 1, c->shape)) || (r = get_i64(args[3], &shift)))
        return r;
    if (shift < 1 || shift >= TERM_BITS)
        return 1;

    /* encoding: code 0 = R, 1 = P, 2 + d m + p = S(d) at list position p; W bits a mesh dim */
    int W = bit_length((uint64_t)(1 + N * m));
    if (W < 2)
        W = 2;
    if (W * m > STATE_BITS)
        return 1;
    c->MASK = ((uint64_t)1 << W) - 1;
    for (int j = 0; j < m; j++)
        c->SH[j] = W * j;
    for (int x = 0; x < 2 + N * m; x++) {
        c->CD[x] = x >= 2 ? (x - 2) / m : -1;
        c->CP[x] = x >= 2 ? (x - 2) % m : -1;
    }

    /* sizes: K_all, lcm, S = K_all * lcm, |X|, |X| S; P and D per mask of mesh dims */
    int64_t K_all = 1, lcm = 1;
    for (int j = 0; j < m; j++) {
        int64_t k = c->ks[j], a = lcm, b = k;
        while (b) {
            int64_t t = a % b;
            a = b;
            b = t;
        }
        lcm = lcm / a * k;
        K_all *= k;
        if (K_all > ((int64_t)1 << 31) || lcm > ((int64_t)1 << 31))
            return 1;
    }
    int64_t S = K_all * lcm, X = 1, XS;
    for (int d = 0; d < N; d++)
        if (__builtin_mul_overflow(X, c->shape[d], &X))
            return 1;
    if (__builtin_mul_overflow(X, S, &XS) || XS >= ((int64_t)1 << 62))
        return 1;
    c->K_all = K_all;
    c->XS = XS;
    for (unsigned mask = 0; mask < (1u << m); mask++) {
        int64_t p = 1;
        for (int j = 0; j < m; j++)
            if (mask >> j & 1)
                p *= c->ks[j];
        c->P[mask] = p;
        c->D[mask] = XS / p;
    }

    /* edge coefficients: AG * phi and AR * phi stay below 2^124 since phi <= |X| */
    u128 cmax = 0;
    for (int j = 0; j < m; j++) {
        int64_t k = c->ks[j], ag, ar;
        if (__builtin_mul_overflow(k - 1, S, &ag) || __builtin_mul_overflow(ag, wb[j], &ag) ||
            __builtin_mul_overflow(2 * (k - 1) * (S / k), wb[j], &ar))
            return 1;
        if ((u128)ag > cmax)
            cmax = (u128)ag;
        if ((u128)ar > cmax)
            cmax = (u128)ar;
        c->AG[j] = (i128)ag << shift;
        c->AR[j] = (i128)ar << shift;
        if (__builtin_mul_overflow(k - 1, wa[j], &v64) || v64 > ((int64_t)1 << 40))
            return 1;
        c->LAT1[j] = v64;
        c->LAT2[j] = 2 * v64;
    }
    if (!fits(cmax * (u128)X, TERM_BITS - (int)shift))
        return 1;
    int64_t hb = -1;
    for (int j = 0; j < m; j++)
        if (c->ks[j] > 1 && wb[j] > 0 && (hb < 0 || wb[j] < hb))
            hb = wb[j];
    if (hb < 0)
        hb = 0;
    c->hmul = (i128)hb << shift;

    /* the bound's units; its move sums (A2, and a successor's a2 <= 2 au2sum) are int64.  A
     * bound value is at most 2 |X| S + K_all a2 and a cycle extra at most au2sum, times hmul. */
    int64_t au2sum = 0;
    for (int j = 0; j < m; j++) {
        int64_t k = c->ks[j];
        c->AU[j] = (k - 1) * (XS / (k * K_all));
        c->AU2[j] = 2 * c->AU[j];
        au2sum += c->AU2[j];
        c->CYW[j] = (i128)c->AU[j] * c->hmul;
    }
    if (au2sum >= ((int64_t)1 << 60))
        return 1;
    if (!fits(((u128)2 * (u128)XS + (u128)K_all * (u128)(2 * au2sum)) * (u128)hb, TERM_BITS - (int)shift))
        return 1;
    return 0;
}

/* optimal._encode, validation included: the state code of a spec and its shard lists L[d] (len[d]
 * long).  With ``target`` every placement but a shard counts as R. */
static int encode(const Ctx *c, const Kit *k, PyObject *pl, PyObject *order, int target, uint64_t *code,
                  int L[MAXN][MAXM], int *len) {
    const int m = c->m, N = c->N;
    int isshard[MAXM], nshard = 0, r;
    uint64_t cd = 0;
    if (!PyTuple_Check(pl) || PyTuple_GET_SIZE(pl) != m || !PyTuple_Check(order))
        return 1;
    for (int j = 0; j < m; j++) {
        PyObject *p = PyTuple_GET_ITEM(pl, j);
        int s = PyObject_IsInstance(p, k->shard_t);
        if (s < 0)
            return -1;
        isshard[j] = s;
        nshard += s;
        if (!s && !target) {
            int q = PyObject_IsInstance(p, k->partial);
            if (q < 0)
                return -1;
            if (q)
                cd |= (uint64_t)1 << c->SH[j];
        }
    }
    for (int d = 0; d < N; d++)
        len[d] = 0;
    unsigned seen = 0, dims = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(order); i++) {
        PyObject *e = PyTuple_GET_ITEM(order, i), *js;
        int64_t d;
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 2 || !PyTuple_Check(js = PyTuple_GET_ITEM(e, 1)))
            return 1;
        if ((r = get_i64(PyTuple_GET_ITEM(e, 0), &d)))
            return r;
        const Py_ssize_t n = PyTuple_GET_SIZE(js);
        if (n == 0 || n > m || d < 0 || d >= N || (dims >> d & 1))
            return 1;
        dims |= 1u << d;
        for (int pos = 0; pos < n; pos++) {
            int64_t j, dim;
            if ((r = get_i64(PyTuple_GET_ITEM(js, pos), &j)))
                return r;
            if (j < 0 || j >= m || (seen >> j & 1) || !isshard[j])
                return 1;
            PyObject *dv = PyObject_GetAttr(PyTuple_GET_ITEM(pl, j), str_dim);
            if (!dv)
                return -1;
            r = get_i64(dv, &dim);
            Py_DECREF(dv);
            if (r)
                return r;
            if (dim != d)
                return 1;
            seen |= 1u << j;
            cd |= (uint64_t)(2 + d * m + pos) << c->SH[j];
            L[d][pos] = (int)j;
        }
        len[d] = (int)n;
    }
    if (__builtin_popcount(seen) != nshard)
        return 1;
    *code = cd;
    return 0;
}

/* {a.reduce_op, b.reduce_op} == {"sum", "avg"} */
static int sum_avg(PyObject *a, PyObject *b) {
    PyObject *x = PyObject_GetAttr(a, str_reduce_op), *y = x ? PyObject_GetAttr(b, str_reduce_op) : NULL;
    int r = -1;
    if (y) {
        int xs = PyObject_RichCompareBool(x, str_sum, Py_EQ), xa = PyObject_RichCompareBool(x, str_avg, Py_EQ);
        int ys = PyObject_RichCompareBool(y, str_sum, Py_EQ), ya = PyObject_RichCompareBool(y, str_avg, Py_EQ);
        r = (xs < 0 || xa < 0 || ys < 0 || ya < 0) ? -1 : ((xs && ya) || (xa && ys));
    }
    Py_XDECREF(x);
    Py_XDECREF(y);
    return r;
}

/* The per-pair tables (optimal._search_python): target facts, goal mask, bound weights, prunings. */
static void pair_setup(Ctx *c, const int *td, unsigned compat, int T[MAXN][MAXM], const int *TL) {
    const int m = c->m, N = c->N;
    c->GM = ~(uint64_t)0;
    c->tSm = 0;
    c->compatm = compat;
    c->Nm = (1u << N) - 1;
    for (int j = 0; j < m; j++) {
        c->TD[j] = td[j];
        c->tS[j] = td[j] >= 0;
        c->tSm |= (unsigned)c->tS[j] << j;
        c->tdbit[j] = td[j] >= 0 ? 1u << td[j] : 0;
        c->compat[j] = (int)(compat >> j & 1);
        if (c->compat[j])
            c->GM &= ~((uint64_t)1 << c->SH[j]);
    }
    for (int d = 0; d < N; d++) {
        c->TL[d] = TL[d];
        for (int p = 0; p < MAXM; p++)
            c->T[d][p] = p < TL[d] ? T[d][p] : -1; /* -1: no target mesh dim (decode's match) */
    }
    int64_t K_end = 1;
    for (int j = 0; j < m; j++)
        if (c->tS[j])
            K_end *= c->ks[j];
    c->PHIEND = c->XS / K_end;
    for (int j = 0; j < m; j++)
        for (int b = 0; b < N; b++) {
            if (c->TD[j] >= 0) {
                int64_t w = c->TD[j] == b ? c->AU2[j] : c->AU[j];
                c->PW[j][b][0] = c->PW[j][b][1] = w;
            } else {
                c->PW[j][b][0] = 0;
                c->PW[j][b][1] = c->AU[j];
            }
        }
    for (int d = 0; d < N; d++) {
        int later = 0;
        for (int p = c->TL[d] - 1; p >= 0; p--) {
            if (c->ks[c->T[d][p]] > 1)
                later = 1;
            c->PK[d][p] = later;
        }
    }
    for (int d = 0; d < N; d++) {
        c->twin[d] = -1;
        if (c->TL[d])
            continue;
        for (int e = 0; e < d; e++)
            if (!c->TL[e] && (c->shape[e] == c->shape[d] ||
                              (c->shape[e] % c->K_all == 0 && c->shape[d] % c->K_all == 0))) {
                c->twin[d] = e;
                break;
            }
    }
}

/* ---------------------------------------------------------------------------------------------
 * the search (the loop of optimal._search_python) */
typedef struct {
    Table best;
    Heap pq;
    int64_t expanded;
    int capped, found, overflow;
    uint64_t goal;
} Run;

/* f of a successor: Python's g2 + (v * hmul + lt if v > 0 else lt); min(a, b).  Without
 * branches (mask arithmetic; no overflow: every operand is below 2^126 in magnitude). */
#define F_OF(g2, v, lt) ((g2) + ((v) & ~((v) >> 127)) * c->hmul + (lt))
#define MIN128(a, b) ((a) + (((b) - (a)) & (((b) - (a)) >> 127)))
#define PUSH(f, ng, s2, pm)                                                                        \
    do {                                                                                           \
        if (heap_push(pq, (f), (ng), (s2), (pm)) < 0)                                              \
            return -1;                                                                             \
    } while (0)
#define IMPROVE(s2, g2, r)                                                                         \
    do {                                                                                           \
        if ((g2) > G_LIMIT)                                                                        \
            goto overflow;                                                                         \
        if (((r) = improve(best, (s2), (g2))) < 0)                                                 \
            return -1;                                                                             \
    } while (0)

static int run_search(const Ctx *c, Run *R, int64_t max_expansions) {
    const int m = c->m, N = c->N;
    const uint64_t MASK = c->MASK;
    const int64_t PHIEND = c->PHIEND;
    const int64_t *D = c->D, *P = c->P;
    Table *best = &R->best;
    Heap *pq = &R->pq;
    size_t x0 = table_find(best, c->start);
    best->key[x0] = c->start;
    best->g[x0] = 0;
    best->prev[x0] = 0;
    best->count = 1;
    PUSH(0, 0, c->start, PACK(-1, 0));
    while (pq->n) {
        const Item it = heap_pop(pq);
        const uint64_t st = it.st;
        const i128 ng = it.ng, g = -ng;
        const size_t cur = table_find(best, st);
        if (g != best->g[cur])
            continue;
        if (PACK_PARENT(it.pm) >= 0)
            best->prev[cur] = (best->prev[cur] & CYC_DONE) | it.pm;
        if ((st & c->GM) == c->gbase) {
            R->found = 1;
            R->goal = st;
            break;
        }
        /* ---- decode: per tensor dim its mesh dims (mask), list positions held (occ: a list is a
         * stack, so its height is the count) and positions that hold their target's mesh dim
         * (match: the final prefix is the run of ones from position 0) */
        int codes[MAXM], H[MAXN], TN[MAXN], FL[MAXN], PD[MAXN];
        unsigned dmask[MAXN], occ[MAXN], match[MAXN];
        int64_t n[MAXN], others[MAXN + 1];
        for (int d = 0; d < N; d++)
            dmask[d] = occ[d] = match[d] = 0;
        for (int j = 0; j < m; j++) {
            int cd = (int)((st >> c->SH[j]) & MASK);
            codes[j] = cd;
            if (cd >= 2) {
                int d = c->CD[cd], p = c->CP[cd];
                dmask[d] |= 1u << j;
                occ[d] |= 1u << p;
                match[d] |= (unsigned)(c->T[d][p] == j) << p;
            }
        }
        /* phi and, for each b, phi / n[b] (the product of the other pieces) */
        int64_t phi = 1;
        for (int d = 0; d < N; d++) {
            n[d] = piece(c, d, dmask[d]);
            others[d] = phi; /* product of n[0..d) for now */
            phi *= n[d];
        }
        {
            int64_t suf = 1;
            for (int d = N - 1; d >= 0; d--) {
                others[d] *= suf;
                suf *= n[d];
            }
        }
        for (int d = 0; d < N; d++) {
            const int h = __builtin_popcount(occ[d]), p = __builtin_ctz(~match[d]);
            H[d] = h;
            FL[d] = p;
            TN[d] = -1;
            PD[d] = 0;
            if (p < c->TL[d]) {
                PD[d] = c->PK[d][p];
                if (p == h)
                    TN[d] = c->T[d][h];
            }
        }
        /* ---- the parent's bound categories, as masks: fm sharded (Python's Kf), cm replicated
         * with a shard target (KC), pm partial to reduce (KP), om the others (KO); tops: the
         * shards last in their list (the ones that may move).  Masks and loops over their bits
         * instead of a branch per mesh dim: these outcomes change from state to state and
         * mispredicted branches are most of the cost of a search. */
        unsigned fm = 0, Rm = 0, Pm = 0, tops = 0;
        for (int j = 0; j < m; j++) {
            const int cd = codes[j];
            fm |= (unsigned)(cd >= 2) << j;
            Pm |= (unsigned)(cd == 1) << j;
            Rm |= (unsigned)(cd == 0) << j;
        }
        const unsigned pm = Pm & ~c->compatm, cm = Rm & c->tSm, om = (Pm & c->compatm) | (Rm & ~c->tSm);
        int64_t LT = 0, A2 = 0, own[MAXM], ownl[MAXM];
        unsigned cycm = 0; /* misplaced shards bound for a shard on another tensor dim */
        for (int j = 0; j < m; j++)
            own[j] = ownl[j] = 0;
        for (unsigned x = pm; x; x &= x - 1) {
            const int j = __builtin_ctz(x);
            LT += c->LAT1[j];
            ownl[j] = c->LAT1[j];
        }
        for (unsigned x = fm; x; x &= x - 1) {
            const int j = __builtin_ctz(x), cd = codes[j], d = c->CD[cd], p = c->CP[cd];
            tops |= (unsigned)(p == H[d] - 1) << j;
            if (p >= FL[d]) { /* misplaced: must leave its place */
                int64_t w2;
                if (c->tS[j]) {
                    const int away = c->TD[j] != d;
                    w2 = away ? c->AU[j] : c->AU2[j];
                    cycm |= (unsigned)away << j;
                } else if (PD[d])
                    w2 = c->AU[j]; /* blocks a pending target entry below it */
                else
                    w2 = 0;
                A2 += w2;
                own[j] = w2;
                LT += c->LAT1[j];
                ownl[j] = c->LAT1[j];
            }
        }
        /* ---- waiting cycles, lazily, once per state */
        if ((cycm & (cycm - 1)) && !(best->prev[cur] & CYC_DONE)) { /* two or more */
            best->prev[cur] |= CYC_DONE;
            int where[MAXM];
            for (unsigned x = cycm; x; x &= x - 1)
                where[__builtin_ctz(x)] = c->CD[codes[__builtin_ctz(x)]];
            i128 extra = cycle_extra(c, cycm, where);
            if (extra) {
                PUSH(it.f + extra, ng, st, it.pm);
                continue;
            }
        }
        R->expanded++;
        if (R->expanded > max_expansions) {
            R->capped = 1;
            break;
        }
        /* ---- exact prunings of pushes onto tensor dim b: a mesh dim may go onto the tensor
         * dims of ok | its target dim */
        unsigned ok = 0;
        for (int b = 0; b < N; b++) {
            const int e = c->twin[b];
            ok |= (unsigned)!((e >= 0 && H[b] == 0 && H[e] == 0) || n[b] <= 1) << b;
        }
        /* ---- successors, in any order (each goes to its own state, so the order changes
         * nothing).  Python's A // (KC * KP) is D[fm | cm | pm], and so on. */
        const int64_t KO = P[om];
        const int64_t pb1 = PHIEND + D[fm | cm] - 2 * D[fm | cm | pm];
        const int64_t pb2 = PHIEND + D[fm | cm | om] - 2 * D[fm | cm | om | pm];
        int r;
        for (unsigned x = tops; x; x &= x - 1) {
            const int j = __builtin_ctz(x), sj = c->SH[j], a = c->CD[codes[j]];
            const unsigned bj = 1u << j;
            const int64_t bA2 = A2 - own[j], bLT = LT - ownl[j];
            const uint64_t cleared = st & ~(MASK << sj);
            /* all-gather -> R (Python's Ag = A * k is D[fm without j]) */
            i128 g2 = g + c->AG[j] * phi + c->LAT1[j];
            IMPROVE(cleared, g2, r);
            if (r) {
                i128 v;
                if (c->tS[j])
                    v = (i128)pb1 + (i128)KO * bA2;
                else {
                    const unsigned f2 = fm & ~bj;
                    v = (i128)(PHIEND + D[f2 | cm] - 2 * D[f2 | cm | pm]) + (i128)P[om | bj] * bA2;
                }
                v = MIN128(v, (i128)pb2 + bA2);
                PUSH(F_OF(g2, v, bLT), -g2, cleared, PACK(st, j));
            }
            /* all-to-all -> S(b), appended last */
            const int64_t mLT = bLT + c->LAT1[j];
            for (unsigned y = (ok | c->tdbit[j]) & ~(1u << a) & c->Nm; y; y &= y - 1) {
                const int b = __builtin_ctz(y);
                g2 = g + (n[b] ? c->AG[j] * (others[b] * piece(c, b, dmask[b] | bj)) : 0) + c->LAT1[j];
                const uint64_t s2 = cleared | ((uint64_t)(2 + b * m + H[b]) << sj);
                IMPROVE(s2, g2, r);
                if (r) {
                    const int fin = TN[b] == j;
                    const int64_t a2 = bA2 + (fin ? 0 : c->PW[j][b][PD[b]]), lt = fin ? bLT : mLT;
                    const i128 v = MIN128((i128)pb1 + (i128)KO * a2, (i128)pb2 + a2);
                    PUSH(F_OF(g2, v, lt), -g2, s2, PACK(st, j | 0x100 | b << 12));
                }
            }
        }
        for (unsigned x = Pm; x; x &= x - 1) {
            /* the source partial: all-reduce -> R, or reduce-scatter -> S(b); pm2 and om2 are
             * Python's cKP and cKO (the categories without j) */
            const int j = __builtin_ctz(x), sj = c->SH[j];
            const unsigned bj = 1u << j;
            const uint64_t cleared = st & ~(MASK << sj);
            const unsigned pm2 = c->compat[j] ? pm : pm & ~bj, om2 = c->compat[j] ? om & ~bj : om;
            const int64_t bLT = LT - ownl[j], cKO = P[om2];
            /* Python's A // (KC * cKO * k), tS or not, and the same without the partials */
            const int64_t b2 = PHIEND + D[fm | bj | cm | om2] - 2 * D[fm | bj | cm | om2 | pm2];
            i128 g2 = g + c->AR[j] * phi + c->LAT2[j];
            IMPROVE(cleared, g2, r);
            if (r) {
                i128 v;
                if (c->tS[j])
                    v = (i128)(PHIEND + D[fm | cm | bj] - 2 * D[fm | cm | bj | pm2]) + (i128)cKO * A2;
                else
                    v = (i128)(PHIEND + D[fm | cm] - 2 * D[fm | cm | pm2]) + (i128)P[om2 | bj] * A2;
                v = MIN128(v, (i128)b2 + A2);
                PUSH(F_OF(g2, v, bLT), -g2, cleared, PACK(st, j | 0x200));
            }
            const int64_t mLT = bLT + c->LAT1[j];
            const int64_t b1 = PHIEND + D[fm | bj | cm] - 2 * D[fm | bj | cm | pm2];
            for (unsigned y = (ok | c->tdbit[j]) & c->Nm; y; y &= y - 1) {
                const int b = __builtin_ctz(y);
                g2 = g + (n[b] ? c->AG[j] * (others[b] * piece(c, b, dmask[b] | bj)) : 0) + c->LAT1[j];
                const uint64_t s2 = cleared | ((uint64_t)(2 + b * m + H[b]) << sj);
                IMPROVE(s2, g2, r);
                if (r) {
                    const int fin = TN[b] == j;
                    const int64_t a2 = A2 + (fin ? 0 : c->PW[j][b][PD[b]]), lt = fin ? bLT : mLT;
                    const i128 v = MIN128((i128)b1 + (i128)cKO * a2, (i128)b2 + a2);
                    PUSH(F_OF(g2, v, lt), -g2, s2, PACK(st, j | 0x300 | b << 12));
                }
            }
        }
        for (unsigned x = Rm; x; x &= x - 1) {
            /* replicated: chunk onto any tensor dim (free), appended last; cm2 and om2 are
             * Python's cKC and cKO */
            const int j = __builtin_ctz(x), sj = c->SH[j];
            const unsigned bj = 1u << j;
            const unsigned cm2 = c->tS[j] ? cm & ~bj : cm, om2 = c->tS[j] ? om : om & ~bj;
            const int64_t mLT = LT + c->LAT1[j], cKO = P[om2];
            const int64_t b1 = PHIEND + D[fm | bj | cm2] - 2 * D[fm | bj | cm2 | pm];
            const int64_t b2 = PHIEND + D[fm | bj | cm2 | om2] - 2 * D[fm | bj | cm2 | om2 | pm];
            for (unsigned y = (ok | c->tdbit[j]) & c->Nm; y; y &= y - 1) {
                const int b = __builtin_ctz(y);
                const uint64_t s2 = st | ((uint64_t)(2 + b * m + H[b]) << sj);
                IMPROVE(s2, g, r);
                if (r) {
                    const int fin = TN[b] == j;
                    const int64_t a2 = A2 + (fin ? 0 : c->PW[j][b][PD[b]]), lt = fin ? LT : mLT;
                    const i128 v = MIN128((i128)b1 + (i128)cKO * a2, (i128)b2 + a2);
                    PUSH(F_OF(g, v, lt), ng, s2, PACK(st, j | 0x400 | b << 12));
                }
            }
        }
    }
    return 0;
overflow:
    R->overflow = 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Steps (optimal._to_steps).  With kit.fast a Step is made as its frozen dataclass __init__
 * makes it (object.__new__, then object.__setattr__ per field; optimal._native_kit checks that
 * Step is such a dataclass), else by calling Step. */
static PyObject *make_step(const Kit *k, int j, PyObject *p, PyObject *q, PyObject *const *cur, int m,
                           PyObject *order) {
    PyObject *jv = PyLong_FromLong(j), *ct = PyTuple_New(m), *s = NULL;
    if (!jv || !ct)
        goto done;
    for (int x = 0; x < m; x++)
        PyTuple_SET_ITEM(ct, x, Py_NewRef(cur[x]));
    PyObject *vals[5] = {jv, p, q, ct, order};
    if (k->fast) {
        PyTypeObject *tp = (PyTypeObject *)k->step;
        PyObject *empty = PyTuple_New(0);
        s = empty ? tp->tp_new(tp, empty, NULL) : NULL;
        Py_XDECREF(empty);
        for (int i = 0; s && i < 5; i++)
            if (PyObject_GenericSetAttr(s, step_fields[i], vals[i]) < 0)
                Py_CLEAR(s);
    } else {
        s = PyObject_Vectorcall(k->step, vals, 5, NULL);
    }
done:
    Py_XDECREF(jv);
    Py_XDECREF(ct);
    return s;
}

/* the shard order ((tensor dim, (mesh dims, ...)), ...) of the lists */
static PyObject *freeze(int N, int L[MAXN][MAXM], const int *len) {
    int n = 0;
    for (int d = 0; d < N; d++)
        n += len[d] > 0;
    PyObject *t = PyTuple_New(n);
    if (!t)
        return NULL;
    for (int d = 0, i = 0; d < N; d++) {
        if (!len[d])
            continue;
        PyObject *e = PyTuple_New(2), *js = PyTuple_New(len[d]), *dv = PyLong_FromLong(d);
        if (!e || !js || !dv) {
            Py_XDECREF(e);
            Py_XDECREF(js);
            Py_XDECREF(dv);
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(e, 0, dv);
        PyTuple_SET_ITEM(e, 1, js);
        PyTuple_SET_ITEM(t, i++, e);
        for (int p = 0; p < len[d]; p++) {
            PyObject *jv = PyLong_FromLong(L[d][p]);
            if (!jv) {
                Py_DECREF(t);
                return NULL;
            }
            PyTuple_SET_ITEM(js, p, jv);
        }
    }
    return t;
}

/* The moves (packed j | kind << 8 | b << 12; kind 0 all-gather, 1 all-to-all, 2 all-reduce,
 * 3 reduce-scatter, 4 chunk) as Steps from the source (lists SL), then the free tail of R -> P
 * partitions and sum <-> avg rescales; checks that the end is the target (lists TL). */
static PyObject *build_steps(const Ctx *c, const Kit *k, const int32_t *mv, Py_ssize_t nmv, PyObject *src,
                             PyObject *src_order, PyObject *dst, int SL[MAXN][MAXM], const int *slen,
                             int TL[MAXN][MAXM], const int *tlen) {
    const int m = c->m, N = c->N;
    int L[MAXN][MAXM], len[MAXN], on[MAXM];
    PyObject *cur[MAXM], *frozen = Py_NewRef(src_order), *out = NULL;
    PyObject **steps = (PyObject **)PyMem_Malloc((size_t)(nmv + m) * sizeof(PyObject *)); /* + the tail */
    Py_ssize_t ns = 0;
    for (int j = 0; j < m; j++) {
        on[j] = -1;
        cur[j] = Py_NewRef(PyTuple_GET_ITEM(src, j));
    }
    for (int d = 0; d < N; d++) {
        len[d] = slen[d];
        for (int p = 0; p < slen[d]; p++) {
            L[d][p] = SL[d][p];
            on[SL[d][p]] = d;
        }
    }
    if (!steps) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nmv; i++) {
        const int j = mv[i] & 0xFF, kind = mv[i] >> 8 & 0xF, b = mv[i] >> 12;
        const int to_shard = kind != 0 && kind != 2;
        PyObject *q = to_shard ? PyTuple_GET_ITEM(k->shards, b) : k->repl;
        PyObject *s = make_step(k, j, cur[j], q, cur, m, frozen);
        if (!s)
            goto done;
        steps[ns++] = s;
        int changed = 0;
        if (on[j] >= 0) { /* a shard leaves its list, from the top (search moves are legal) */
            len[on[j]]--;
            on[j] = -1;
            changed = 1;
        }
        if (to_shard) {
            L[b][len[b]++] = j;
            on[j] = b;
            changed = 1;
        }
        if (changed) {
            PyObject *f = freeze(N, L, len);
            if (!f)
                goto done;
            Py_SETREF(frozen, f);
        }
        Py_SETREF(cur[j], Py_NewRef(q));
    }
    for (int j = 0; j < m; j++) {
        PyObject *t = PyTuple_GET_ITEM(dst, j);
        int isp = PyObject_IsInstance(t, k->partial), eq = 0;
        if (isp < 0 || (isp && (eq = PyObject_RichCompareBool(cur[j], t, Py_EQ)) < 0))
            goto done;
        if (isp && !eq) {
            PyObject *s = make_step(k, j, cur[j], t, cur, m, frozen);
            if (!s)
                goto done;
            steps[ns++] = s;
            Py_SETREF(cur[j], Py_NewRef(t));
        }
    }
    /* the end must be the target (the assert of optimal._to_steps) */
    for (int d = 0; d < N; d++) {
        int same = len[d] == tlen[d];
        for (int p = 0; same && p < len[d]; p++)
            same = L[d][p] == TL[d][p];
        if (!same) {
            PyErr_SetString(PyExc_AssertionError, "native plan: the moves do not end in the target shard order");
            goto done;
        }
    }
    for (int j = 0; j < m; j++) {
        PyObject *t = PyTuple_GET_ITEM(dst, j);
        if (on[j] >= 0 || cur[j] == t || (Py_IS_TYPE(cur[j], (PyTypeObject *)k->repl_t) &&
                                          Py_IS_TYPE(t, (PyTypeObject *)k->repl_t)))
            continue; /* shards: checked with the lists; R == R */
        int eq = PyObject_RichCompareBool(cur[j], t, Py_EQ);
        if (eq < 0)
            goto done;
        if (!eq) {
            PyErr_SetString(PyExc_AssertionError, "native plan: the moves do not end in the target placements");
            goto done;
        }
    }
    if (!(out = PyTuple_New(ns)))
        goto done;
    for (Py_ssize_t i = 0; i < ns; i++)
        PyTuple_SET_ITEM(out, i, steps[i]);
    ns = 0; /* the tuple owns them */
done:
    for (Py_ssize_t i = 0; i < ns; i++)
        Py_DECREF(steps[i]);
    PyMem_Free(steps);
    for (int j = 0; j < m; j++)
        Py_DECREF(cur[j]);
    Py_DECREF(frozen);
    return out;
}

/* ---------------------------------------------------------------------------------------------
 * plan(ks, wb, wa, shift, shape, src, src_order, dst, dst_order, max_expansions, kit)
 *   -> (steps or None, expanded, generated, capped), or None: optimal._search_python in C, with
 *   its arguments already normalized by optimal.py; None when anything does not fit or is
 *   invalid (the caller then runs the Python planner, which raises the errors). */
static PyObject *result(PyObject *steps, int64_t expanded, size_t generated, int capped) {
    if (!steps)
        return NULL;
    return Py_BuildValue("(NLnO)", steps, (long long)expanded, (Py_ssize_t)generated, capped ? Py_True : Py_False);
}

static PyObject *astar_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "plan() takes 11 arguments");
        return NULL;
    }
    PyObject *src = args[5], *src_order = args[6], *dst = args[7], *dst_order = args[8];
    Kit k;
    Ctx c;
    int64_t max_expansions;
    uint64_t start, gbase;
    int SL[MAXN][MAXM], slen[MAXN], TL[MAXN][MAXM], tlen[MAXN], r;
    if ((r = get_kit(args[10], &k)) || (r = mesh_setup(&c, args)) || (r = get_i64(args[9], &max_expansions)) ||
        (r = encode(&c, &k, src, src_order, 0, &start, SL, slen)) ||
        (r = encode(&c, &k, dst, dst_order, 1, &gbase, TL, tlen))) {
        if (r < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    const int m = c.m, N = c.N;
    if (start == gbase) {
        int eq = PyObject_RichCompareBool(src, dst, Py_EQ);
        if (eq < 0)
            return NULL;
        if (eq)
            return result(PyTuple_New(0), 0, 0, 0);
    }
    /* target facts: the target's tensor dim of each shard; a target partial may keep a
     * compatible source partial (the same, or sum <-> avg) */
    int td[MAXM];
    unsigned compat = 0;
    for (int j = 0; j < m; j++)
        td[j] = -1;
    for (int d = 0; d < N; d++)
        for (int p = 0; p < tlen[d]; p++)
            td[TL[d][p]] = d;
    for (int j = 0; j < m; j++) {
        PyObject *a = PyTuple_GET_ITEM(src, j), *b = PyTuple_GET_ITEM(dst, j);
        if (td[j] >= 0)
            continue;
        int isp = PyObject_IsInstance(b, k.partial);
        if (isp < 0)
            return NULL;
        if (!isp)
            continue;
        int ok = PyObject_RichCompareBool(a, b, Py_EQ);
        if (ok == 0 && Py_IS_TYPE(a, (PyTypeObject *)k.partial) && Py_IS_TYPE(b, (PyTypeObject *)k.partial))
            ok = sum_avg(a, b);
        if (ok < 0)
            return NULL;
        if (ok)
            compat |= 1u << j;
    }
    pair_setup(&c, td, compat, TL, tlen);
    if ((start & c.GM) == gbase)
        return result(build_steps(&c, &k, NULL, 0, src, src_order, dst, SL, slen, TL, tlen), 0, 0, 0);

    /* zero-cost plans (see optimal._search_python): every source list a prefix of its target
     * list, the rest of the target lists replicated now, every source partial compatible */
    {
        int32_t chunks[MAXM];
        int nch = 0, ok = 1;
        for (int d = 0; ok && d < N; d++) {
            if (!tlen[d])
                continue;
            if (slen[d] > tlen[d])
                ok = 0;
            for (int p = 0; ok && p < slen[d]; p++)
                ok = SL[d][p] == TL[d][p];
            for (int p = slen[d]; ok && p < tlen[d]; p++) {
                PyObject *s = PyTuple_GET_ITEM(src, TL[d][p]);
                int isr = s == k.repl ? 1 : PyObject_IsInstance(s, k.repl_t);
                if (isr < 0)
                    return NULL;
                ok = isr;
                chunks[nch++] = TL[d][p] | 4 << 8 | d << 12;
            }
        }
        for (int d = 0; ok && d < N; d++)
            ok = !slen[d] || tlen[d]; /* a source list whose tensor dim has none in the target */
        for (int j = 0; ok && j < m; j++)
            ok = ((start >> c.SH[j]) & c.MASK) != 1 || (compat >> j & 1);
        if (ok)
            return result(build_steps(&c, &k, chunks, nch, src, src_order, dst, SL, slen, TL, tlen), 0, 0, 0);
    }

    /* the search */
    c.start = start;
    c.gbase = gbase;
    Run R;
    memset(&R, 0, sizeof(R));
    PyObject *out = NULL;
    int32_t *mv = NULL;
    size_t nt = (size_t)N << m;
    c.NT = (int64_t *)PyMem_Malloc((nt ? nt : 1) * sizeof(int64_t));
    if (!c.NT || heap_init(&R.pq, 1024) < 0 || table_init(&R.best, 11) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    memset(c.NT, 0xFF, nt * sizeof(int64_t));
    if (run_search(&c, &R, max_expansions) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (R.overflow) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    if (!R.found) {
        out = result(Py_NewRef(Py_None), R.expanded, R.best.count, R.capped);
        goto done;
    }
    /* walk the parent pointers back to the start: at most one step per state */
    Py_ssize_t len = 0;
    mv = (int32_t *)PyMem_Malloc((R.best.count + 1) * sizeof(int32_t));
    if (!mv) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint64_t s = R.goal; s != c.start;) {
        const size_t x = table_find(&R.best, s);
        const uint64_t pmv = R.best.prev[x] & ~CYC_DONE;
        if (R.best.key[x] != s || PACK_PARENT(pmv) < 0 || (size_t)len >= R.best.count) {
            out = Py_NewRef(Py_None); /* cannot happen; the caller then plans in Python */
            goto done;
        }
        mv[len++] = PACK_MOVE(pmv);
        s = (uint64_t)PACK_PARENT(pmv);
    }
    for (Py_ssize_t i = 0; i < len / 2; i++) {
        int32_t t = mv[i];
        mv[i] = mv[len - 1 - i];
        mv[len - 1 - i] = t;
    }
    out = result(build_steps(&c, &k, mv, len, src, src_order, dst, SL, slen, TL, tlen), R.expanded, R.best.count,
                 R.capped);
done:
    PyMem_Free(mv);
    PyMem_Free(c.NT);
    table_free(&R.best);
    heap_free(&R.pq);
    return out;
}

static PyMethodDef methods[] = {
    {"plan", (PyCFunction)(void (*)(void))astar_plan, METH_FASTCALL,
     "plan(ks, wb, wa, shift, shape, src, src_order, dst, dst_order, max_expansions, kit)\n"
     "optimal._search_python in C: (steps or None when capped, expanded, generated, capped), or\n"
     "None when the inputs do not fit the native integer widths or are invalid (the caller then\n"
     "plans in Python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_astar", "Native A* redistribution planner of shardtensor.redistribute.optimal.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__astar(void) {
    static const char *fields[5] = {"mesh_dim", "src", "dst", "placements", "order"};
    for (int i = 0; i < 5; i++)
        if (!step_fields[i] && !(step_fields[i] = PyUnicode_InternFromString(fields[i])))
            return NULL;
    if ((!str_dim && !(str_dim = PyUnicode_InternFromString("dim"))) ||
        (!str_reduce_op && !(str_reduce_op = PyUnicode_InternFromString("reduce_op"))) ||
        (!str_sum && !(str_sum = PyUnicode_InternFromString("sum"))) ||
        (!str_avg && !(str_avg = PyUnicode_InternFromString("avg"))))
        return NULL;
    return PyModule_Create(&module);
}
