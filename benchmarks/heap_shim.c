/* Heap accounting for bench_distributed.py: LD_PRELOADed into a rank, it sees every thread's allocations.

   torch.profiler records only the allocations and frees made on the profiled thread; gloo's work threads allocate
   and free too. This shim wraps the malloc family (glibc's __libc_* underneath) and keeps, for the whole process:
     - the live bytes of the blocks made by posix_memalign: torch's CPU allocator (c10::alloc_cpu) allocates every
       tensor with it; remembered in a pointer table, so that their frees are recognised on any thread;
     - the live bytes of every block (malloc_usable_size): torch's tensors plus gloo's own buffers, Python, ...;
   each with its peak since shim_reset(), and the bytes of the tensor blocks allocated and freed off the thread
   that called shim_reset(). Counting runs always (an atomic add per call, a table look-up for 64-byte aligned
   frees), so the window reset..read sees frees of blocks allocated before it too: peaks are above the live bytes
   at the reset.

   Build: cc -O2 -shared -fPIC -o libheap_shim.so heap_shim.c -lpthread   (Linux, glibc) */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

#define TABLE_BITS 20 /* open addressing, linear probing: up to ~700k live tensor blocks */
#define TABLE_SIZE (1u << TABLE_BITS)
static uintptr_t keys[TABLE_SIZE];
static size_t sizes[TABLE_SIZE];
static atomic_flag table_lock = ATOMIC_FLAG_INIT;
static _Atomic long table_count;

static _Atomic long all_cur, all_peak, tensor_cur, tensor_peak;
static _Atomic long off_alloc_bytes, off_alloc_count, off_free_bytes, off_free_count;
static pthread_t main_thread;
static _Atomic int have_main;

static inline void raise_peak(_Atomic long *peak, long c) {
  long p = atomic_load_explicit(peak, memory_order_relaxed);
  while (c > p && !atomic_compare_exchange_weak(peak, &p, c)) {
  }
}
static inline int off_main(void) { return atomic_load(&have_main) && !pthread_equal(pthread_self(), main_thread); }
static inline size_t slot(uintptr_t k) { return (size_t)((k >> 6) * 0x9E3779B97F4A7C15ull >> (64 - TABLE_BITS)); }
static inline void lock(void) {
  while (atomic_flag_test_and_set_explicit(&table_lock, memory_order_acquire)) {
  }
}
static inline void unlock(void) { atomic_flag_clear_explicit(&table_lock, memory_order_release); }

static void table_insert(uintptr_t k, size_t n) {
  lock();
  size_t i = slot(k);
  while (keys[i] != 0 && keys[i] != k) i = (i + 1) & (TABLE_SIZE - 1);
  if (keys[i] == 0) atomic_fetch_add(&table_count, 1);
  keys[i] = k;
  sizes[i] = n;
  unlock();
}
/* the block's size if k is a tensor block (and forget it), else 0 */
static size_t table_remove(uintptr_t k) {
  size_t n = 0;
  lock();
  size_t i = slot(k);
  while (keys[i] != 0 && keys[i] != k) i = (i + 1) & (TABLE_SIZE - 1);
  if (keys[i] == k) {
    n = sizes[i];
    atomic_fetch_sub(&table_count, 1);
    /* backward-shift deletion keeps every probe chain unbroken */
    size_t j = i;
    for (;;) {
      keys[i] = 0;
      for (;;) {
        j = (j + 1) & (TABLE_SIZE - 1);
        if (keys[j] == 0) goto done;
        size_t h = slot(keys[j]);
        if ((i <= j) ? (i < h && h <= j) : (i < h || h <= j)) continue;
        break;
      }
      keys[i] = keys[j];
      sizes[i] = sizes[j];
      i = j;
    }
  }
done:
  unlock();
  return n;
}

static inline void account_alloc(void *q) {
  if (q) raise_peak(&all_peak, atomic_fetch_add(&all_cur, (long)malloc_usable_size(q)) + (long)malloc_usable_size(q));
}
static inline void account_free(void *q) {
  if (!q) return;
  atomic_fetch_sub(&all_cur, (long)malloc_usable_size(q));
  if (((uintptr_t)q & 63) == 0 && atomic_load_explicit(&table_count, memory_order_relaxed) > 0) {
    size_t n = table_remove((uintptr_t)q);
    if (n) {
      atomic_fetch_sub(&tensor_cur, (long)n);
      if (off_main()) {
        atomic_fetch_add(&off_free_bytes, (long)n);
        atomic_fetch_add(&off_free_count, 1);
      }
    }
  }
}

void *malloc(size_t n) {
  void *q = __libc_malloc(n);
  account_alloc(q);
  return q;
}
void *calloc(size_t a, size_t b) {
  void *q = __libc_calloc(a, b);
  account_alloc(q);
  return q;
}
void free(void *q) {
  account_free(q);
  __libc_free(q);
}
void *realloc(void *q, size_t n) {
  if (q == NULL) return malloc(n);
  if (n == 0) {
    free(q);
    return NULL;
  }
  long old = (long)malloc_usable_size(q);
  void *r = __libc_realloc(q, n);
  if (r) {
    if (((uintptr_t)q & 63) == 0 && atomic_load(&table_count) > 0) {
      size_t t = table_remove((uintptr_t)q);
      if (t) atomic_fetch_sub(&tensor_cur, (long)t); /* a reallocated tensor block is a plain block now */
    }
    atomic_fetch_sub(&all_cur, old);
    account_alloc(r);
  }
  return r;
}
void *memalign(size_t a, size_t n) {
  void *q = __libc_memalign(a, n);
  account_alloc(q);
  return q;
}
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
  void *q = __libc_memalign(a, n);
  if (!q) return ENOMEM;
  account_alloc(q);
  if (a >= 64) { /* c10::alloc_cpu asks for 64-byte (or page) alignment */
    table_insert((uintptr_t)q, n);
    long c = atomic_fetch_add(&tensor_cur, (long)n) + (long)n;
    raise_peak(&tensor_peak, c);
    if (off_main()) {
      atomic_fetch_add(&off_alloc_bytes, (long)n);
      atomic_fetch_add(&off_alloc_count, 1);
    }
  }
  *out = q;
  return 0;
}

/* -- read by bench_distributed.py through ctypes --------------------------------------------------------------- */
void shim_reset(void) {
  main_thread = pthread_self();
  atomic_store(&have_main, 1);
  atomic_store(&all_peak, atomic_load(&all_cur));
  atomic_store(&tensor_peak, atomic_load(&tensor_cur));
  atomic_store(&off_alloc_bytes, 0);
  atomic_store(&off_alloc_count, 0);
  atomic_store(&off_free_bytes, 0);
  atomic_store(&off_free_count, 0);
}
long shim_all_current(void) { return atomic_load(&all_cur); }
long shim_all_peak(void) { return atomic_load(&all_peak); }
long shim_tensor_current(void) { return atomic_load(&tensor_cur); }
long shim_tensor_peak(void) { return atomic_load(&tensor_peak); }
long shim_off_main_alloc_bytes(void) { return atomic_load(&off_alloc_bytes); }
long shim_off_main_alloc_count(void) { return atomic_load(&off_alloc_count); }
long shim_off_main_free_bytes(void) { return atomic_load(&off_free_bytes); }
long shim_off_main_free_count(void) { return atomic_load(&off_free_count); }
