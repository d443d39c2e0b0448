/* Tensor-memory counter of every thread, for the multi-process benchmarks (LD_PRELOADed into each rank).

   torch.profiler records the allocations of the profiled thread only, and gloo's work threads allocate and free
   tensors too. torch's CPU allocator (c10::alloc_cpu) takes every tensor block from posix_memalign with 64-byte or
   page alignment: this shim remembers those blocks in a pointer table, so that a free on any thread is recognised,
   and keeps their live bytes and the peak since shim_reset(). Build (Linux, glibc):
   cc -O2 -shared -fPIC -o libheap_shim.so heap_shim.c */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

#define BITS 20 /* open addressing, linear probing: up to ~700k live tensor blocks */
#define SIZE (1u << BITS)
static uintptr_t keys[SIZE];
static size_t sizes[SIZE];
static atomic_flag table_lock = ATOMIC_FLAG_INIT;
static _Atomic long live, current, peak;

static size_t slot(uintptr_t k) { return (size_t)((k >> 6) * 0x9E3779B97F4A7C15ull >> (64 - BITS)); }
static void lock(void) {
  while (atomic_flag_test_and_set_explicit(&table_lock, memory_order_acquire)) {
  }
}
static void unlock(void) { atomic_flag_clear_explicit(&table_lock, memory_order_release); }

int posix_memalign(void **out, size_t align, size_t n) {
  void *q = __libc_memalign(align, n);
  if (!q) return ENOMEM;
  if (align >= 64) {
    lock();
    size_t i = slot((uintptr_t)q);
    while (keys[i] != 0) i = (i + 1) & (SIZE - 1);
    keys[i] = (uintptr_t)q;
    sizes[i] = n;
    live++;
    unlock();
    long c = atomic_fetch_add(&current, (long)n) + (long)n;
    long p = atomic_load(&peak);
    while (c > p && !atomic_compare_exchange_weak(&peak, &p, c)) {
    }
  }
  *out = q;
  return 0;
}

void free(void *q) {
  uintptr_t k = (uintptr_t)q;
  if (k && (k & 63) == 0 && atomic_load_explicit(&live, memory_order_relaxed) > 0) {
    lock();
    size_t i = slot(k);
    while (keys[i] != 0 && keys[i] != k) i = (i + 1) & (SIZE - 1);
    if (keys[i] == k) {
      atomic_fetch_sub(&current, (long)sizes[i]);
      live--;
      for (size_t j = i;;) { /* backward-shift deletion keeps every probe chain unbroken */
        keys[i] = 0;
        for (;;) {
          j = (j + 1) & (SIZE - 1);
          if (keys[j] == 0) goto done;
          size_t h = slot(keys[j]);
          if (!((i <= j) ? (i < h && h <= j) : (i < h || h <= j))) break;
        }
        keys[i] = keys[j];
        sizes[i] = sizes[j];
        i = j;
      }
    }
  done:
    unlock();
  }
  __libc_free(q);
}

/* read through ctypes by benchmarks/harness.py */
void shim_reset(void) { atomic_store(&peak, atomic_load(&current)); }
long shim_current(void) { return atomic_load(&current); }
long shim_peak(void) { return atomic_load(&peak); }
