/* A malloc counter for the memory tests (tests/_memcount.py): preloaded into a process
 * (LD_PRELOAD), it counts the bytes every thread holds from the C allocator (torch's CPU
 * tensors, gloo's buffers, flatshard's) and the highest count since the last reset: the
 * true peak, not a sample. Python's small objects come from its own arenas (mmap) and are
 * not counted. glibc only (it forwards to glibc's __libc_* entry points). */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static _Atomic long long in_use = 0;
static _Atomic long long peak = 0;

static void added(void *p) {
    if (!p) return;
    long long now = atomic_fetch_add(&in_use, (long long)malloc_usable_size(p)) + (long long)malloc_usable_size(p);
    long long seen = atomic_load(&peak);
    while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {}
}

static void removed(void *p) {
    if (p) atomic_fetch_sub(&in_use, (long long)malloc_usable_size(p));
}

void *malloc(size_t n) { void *p = __libc_malloc(n); added(p); return p; }
void *calloc(size_t n, size_t m) { void *p = __libc_calloc(n, m); added(p); return p; }
void free(void *p) { removed(p); __libc_free(p); }
void *realloc(void *old, size_t n) {
    removed(old);
    void *p = __libc_realloc(old, n);
    if (p) added(p);
    else if (old && n) added(old); /* failed: the old block stays */
    return p;
}
void *memalign(size_t a, size_t n) { void *p = __libc_memalign(a, n); added(p); return p; }
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p = memalign(a, n);
    if (!p && n) return ENOMEM;
    *out = p;
    return 0;
}
void *valloc(size_t n) { return memalign(4096, n); }

long long flatshard_memcount_in_use(void) { return atomic_load(&in_use); }
long long flatshard_memcount_peak(void) { return atomic_load(&peak); }
void flatshard_memcount_reset_peak(void) { atomic_store(&peak, atomic_load(&in_use)); }
