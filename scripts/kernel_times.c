// Per-kernel GPU time of a process, for finding where a decode step's time goes on a machine
// without Nsight: an LD_PRELOAD library that records every kernel (graph launches included)
// through CUPTI's activity API and prints, at exit, time per kernel name (total, count, mean),
// largest first. KERNEL_TIMES_GRID=1: per kernel name and grid size (a matrix's shape, for a
// kernel whose grid follows it). Built and used by scripts/gpu-kernel-times.sh.
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KREC
#error "define KREC as the newest CUpti_ActivityKernelN of this CUPTI"
#endif

#define BUF_BYTES (16u << 20)
#define MAX_NAMES 4096

typedef struct {
    char name[160];
    unsigned long long total_ns, count;
} Entry;
static Entry entries[MAX_NAMES];
static int n_entries;

static void add(const char* name, unsigned long long ns) {
    for (int i = 0; i < n_entries; ++i)
        if (strncmp(entries[i].name, name, sizeof entries[i].name - 1) == 0) {
            entries[i].total_ns += ns;
            entries[i].count++;
            return;
        }
    if (n_entries < MAX_NAMES) {
        strncpy(entries[n_entries].name, name, sizeof entries[n_entries].name - 1);
        entries[n_entries].total_ns = ns;
        entries[n_entries].count = 1;
        n_entries++;
    }
}

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = (uint8_t*)aligned_alloc(8, BUF_BYTES);
    *size = BUF_BYTES;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    CUpti_Activity* rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const KREC* k = (const KREC*)rec;
            const char* name = k->name ? k->name : "?";
            static int by_grid = -1;
            if (by_grid < 0) by_grid = getenv("KERNEL_TIMES_GRID") != NULL;
            if (by_grid) {
                char key[160];
                snprintf(key, sizeof key, "%.120s grid %dx%dx%d", name, k->gridX, k->gridY, k->gridZ);
                add(key, k->end - k->start);
            } else
                add(name, k->end - k->start);
        }
    }
    free(buffer);
}

static int by_total(const void* a, const void* b) {
    const Entry *x = (const Entry*)a, *y = (const Entry*)b;
    return x->total_ns < y->total_ns ? 1 : x->total_ns > y->total_ns ? -1 : 0;
}

__attribute__((constructor)) static void start(void) {
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}

__attribute__((destructor)) static void finish(void) {
    cuptiActivityFlushAll(1);
    qsort(entries, n_entries, sizeof(Entry), by_total);
    FILE* f = stderr;
    const char* path = getenv("KERNEL_TIMES_OUT");
    if (path && (f = fopen(path, "w")) == NULL) f = stderr;
    fprintf(f, "| kernel | total ms | count | mean us |\n|---|---|---|---|\n");
    for (int i = 0; i < n_entries && i < 60; ++i)
        fprintf(f, "| %s | %.3f | %llu | %.2f |\n", entries[i].name, entries[i].total_ns / 1e6, entries[i].count,
                entries[i].total_ns / 1e3 / entries[i].count);
    if (f != stderr) fclose(f);
}
