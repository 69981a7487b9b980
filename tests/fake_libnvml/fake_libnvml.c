/* A fake libnvidia-ml.so.1: the NVML functions mig-exporter and nvitop-exporter call, with
 * nvml.h's signatures and struct layouts, answering from a scenario file read at nvmlInit
 * (path in FAKE_NVML_SCENARIO), written by tests/fake_nvml_c.py from the same FakeNvmlScenario
 * as the Python fake (tests/fake_nvml.py). Its answers follow that fake's, function by
 * function; see README.md beside it for the file format and how to add a function. */

#define _GNU_SOURCE
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_NO_DATA 21
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define EXPORT __attribute__((visibility("default")))

/* ---- nvml.h's structs (checked against pynvml's ctypes classes by tests/test_fake_libnvml.py) ---- */

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24)))
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
/* nvmlProcessInfo_v2_t, which the _v2 and _v3 process lists fill (nvml.h's nvmlProcessInfo_t). */
typedef struct {
    unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_v1_t;
#define nvmlTemperature_v1 ((unsigned int)(sizeof(nvmlTemperature_v1_t) | (1 << 24)))
typedef union {
    double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal; long long sllVal;
    int siVal; unsigned short usVal;
} nvmlValue_t;
typedef struct {
    unsigned int fieldId, scopeId; long long timestamp, latencyUsec; int valueType; nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;
typedef struct {
    unsigned int pid; unsigned long long timeStamp; unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
/* GPM (nvml.h, "For Hopper or newer"): a sample is opaque to callers; this library's is below. The
 * metrics array is declared without a bound on purpose: nvml.h sizes it NVML_GPM_METRIC_MAX, which
 * each binding sets differently (pynvml: 98, 210, 333, 477) under the same version word 1, so only
 * metrics[0:numMetrics] may be touched and the struct's size never checked. */
typedef struct fake_gpm_sample *nvmlGpmSample_t;
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t;
#define NVML_GPM_SUPPORT_VERSION 1
typedef struct { char *shortName, *longName, *unit; } nvmlGpmMetricInfo_t; /* nvml.h's metricInfo */
typedef struct {
    unsigned int metricId; nvmlReturn_t nvmlReturn; double value; nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;
typedef struct {
    unsigned int version, numMetrics; nvmlGpmSample_t sample1, sample2; nvmlGpmMetric_t metrics[];
} nvmlGpmMetricsGet_t;
#define NVML_GPM_METRICS_GET_VERSION 1
typedef struct { unsigned int version; int marginTemperature; } nvmlMarginTemperature_v1_t;
#define nvmlMarginTemperature_v1 ((unsigned int)(sizeof(nvmlMarginTemperature_v1_t) | (1 << 24)))
typedef struct {
    unsigned int version;
    unsigned long long aggregateUncParity, aggregateUncSecDed, aggregateCor, volatileUncParity, volatileUncSecDed,
        volatileCor, aggregateUncBucketL2, aggregateUncBucketSm, aggregateUncBucketPcie, aggregateUncBucketMcu,
        aggregateUncBucketOther;
    unsigned int bThresholdExceeded;
} nvmlEccSramErrorStatus_v1_t;
#define nvmlEccSramErrorStatus_v1 ((unsigned int)(sizeof(nvmlEccSramErrorStatus_v1_t) | (1 << 24)))
typedef struct { unsigned int max, high, partial, low, none; } nvmlRowRemapperHistogramValues_t;
typedef struct { unsigned int version, bChannelRepairPending, bTpcRepairPending; } nvmlRepairStatus_v1_t;
#define nvmlRepairStatus_v1 ((unsigned int)(sizeof(nvmlRepairStatus_v1_t) | (1 << 24)))

/* nvml.h's enums and field ids the health calls check or answer from (compared with pynvml's by the tests) */
#define NVML_CLOCK_COUNT 4
#define NVML_TEMPERATURE_THRESHOLD_COUNT 8
#define NVML_MEMORY_LOCATION_COUNT 8
#define NVML_MEMORY_LOCATION_SRAM 7
#define NVML_MEMORY_ERROR_TYPE_UNCORRECTED 1
#define NVML_VOLATILE_ECC 0
#define NVML_PAGE_RETIREMENT_CAUSE_COUNT 2
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION 83
#define NVML_FI_DEV_PCIE_REPLAY_COUNTER 94
/* tests/fake_nvml.py's RETIRED_AT: the timestamp of the first retired page, each next one a second later */
#define RETIRED_AT 1717171717ull

#define NVML_TEMPERATURE_GPU 0
#define NO_INSTANCE_ID 0xFFFFFFFFu
#define UNKNOWN_MEMORY 0xFFFFFFFFFFFFFFFFull
#define R535_GARBAGE_BYTES 0x0000FFFFFFFFFFFFull

/* ---- the scenario ---- */

enum { COMPUTE, GRAPHICS, MPS, KINDS };
#define MAX_SLOTS 8

struct proc { unsigned int pid; unsigned long long used; };
struct plist { struct proc *v; unsigned int n, cap; };
struct fail { char name[80]; int code; };

/* A card's heat, power and wear: tests/fake_nvml.py's FakeHealth; has_* 0 answers NOT_SUPPORTED. */
struct field { unsigned int id; int type, code; int has_value; unsigned long long value; };
struct pages { unsigned long long *v; unsigned int n; };
struct health {
    struct field *fields; int nfields;
    int has_margin; int margin;
    int has_threshold[NVML_TEMPERATURE_THRESHOLD_COUNT]; unsigned int threshold[NVML_TEMPERATURE_THRESHOLD_COUNT];
    int has_reasons, has_supported_reasons; unsigned long long reasons, supported_reasons;
    int has_pstate; unsigned int pstate;
    int has_clock[NVML_CLOCK_COUNT], has_max_clock[NVML_CLOCK_COUNT];
    unsigned int clock[NVML_CLOCK_COUNT], max_clock[NVML_CLOCK_COUNT];
    int has_fan; unsigned int fan;
    int has_limit[5]; unsigned int limit[5]; /* enforced, management, default, min, max */
    int has_ecc_mode; unsigned int ecc_current, ecc_pending;
    int has_ecc[2][2][NVML_MEMORY_LOCATION_COUNT]; /* error type, counter type, location */
    unsigned long long ecc[2][2][NVML_MEMORY_LOCATION_COUNT];
    int has_sram; unsigned long long sram[6]; unsigned int sram_threshold; /* VP VS VC AP AS AC */
    int has_remapped; unsigned int remapped[4]; /* correctable, uncorrectable, pending, failure */
    int has_histogram; unsigned int histogram[5]; /* max, high, partial, low, none */
    int has_retired; struct pages retired[NVML_PAGE_RETIREMENT_CAUSE_COUNT];
    int has_retired_pending; unsigned int retired_pending;
    int has_repair; unsigned int repair_channel, repair_tpc;
    int has_unrepairable; unsigned int unrepairable;
    int has_link; unsigned int link[4]; /* current generation, max generation, current width, max width */
};

/* A card's activity: GPM support, scripted GPM activity of the whole card and of its GPU instances,
 * per-metric return codes, GPU instances without a compute instance, and the per-process
 * utilisation samples of nvmlDeviceGetProcessUtilization (the GPM region, below). */
struct gpm_step { long long gi; unsigned int metric; double from_s, percent; }; /* gi WHOLE_CARD: the card */
struct gpm_fail { unsigned int metric; int code; }; /* the card's and its GPU instances' alike */
struct putil { unsigned int pid; unsigned long long at_us; unsigned int sm, mem, enc, dec; };
/* A process's scripted shares (sm, mem, enc, dec %) from fake time from_s on: what the driver samples
 * of it each period while any is above 0 (the Python fake's FakeCard.process_activity). */
struct pscript { unsigned int pid; double from_s; long long from_us; unsigned int share[4]; };
struct activity {
    int gpm;                                /* nvmlGpmQueryDeviceSupport's isSupportedDevice */
    struct gpm_step *steps; int nsteps;     /* ordered by from_s; a later line wins a tie */
    struct gpm_fail *fails; int nfails;
    unsigned int *bare_gi; int nbare;       /* GPU instances without a compute instance */
    struct putil *putil; int nputil;
    struct pscript *pscripts; int npscripts; /* ordered by from_s; a later line wins a tie */
    unsigned long long period_us;            /* the driver's sample period (putil_period; 0: 166 667) */
    int merged;                              /* one sample a process a call (putil_merged) */
};

struct fake_dev {
    int card;      /* index of the card */
    int slot;      /* MIG slot, -1 for the card itself */
    char name[128], uuid[96], bus[32], profile[64];
    unsigned int pci_device_id, pci_subsystem_id;
    int has_memory; unsigned long long total, reserved, used, free;
    int has_mig_mode, mig_current, mig_pending;
    int has_temperature; unsigned int temperature;
    int has_power; unsigned int power_mw;
    int has_util; unsigned int util_gpu, util_memory;
    unsigned int max_mig;
    char serial[64]; int has_serial; /* nvmlDeviceGetSerial: the card's, on its MIG handles too */
    unsigned int gi, ci;
    struct health health;   /* a card's */
    int has_sram_unc; unsigned long long sram_unc; /* a MIG device's own volatile uncorrectable SRAM errors */
    int mig_dev[MAX_SLOTS]; /* index into devs, -1 for an empty slot */
    struct plist lists[KINDS];
    struct fail *fails; int nfails;
    unsigned int grow[KINDS]; /* entries that appear once this list was sized once */
    int sized[KINDS];
    struct activity activity; /* a card's */
};
typedef struct fake_dev *nvmlDevice_t;

struct pname { unsigned int pid; char *name; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int loaded, init_count, init_error, r535;
static char driver_version[80], nvml_version[80];
static int cuda_version;
static struct fake_dev *devs;
static int ndevs, ncards, *card_dev;
static struct pname *pnames;
static int npnames;
static struct fail *sys_fails;
static int nsys_fails;
static char hang_function[80];
static long hang_after; /* calls answered before the hang */


/* %XX escapes, as tests/fake_nvml_c.py writes strings (spaces and non-ASCII bytes included). */
static void unescape(char *s) {
    char *out = s;
    for (; *s; s++) {
        if (s[0] == '%' && s[1] && s[2]) {
            char hex[3] = {s[1], s[2], 0};
            *out++ = (char)strtol(hex, NULL, 16);
            s += 2;
        } else {
            *out++ = *s;
        }
    }
    *out = 0;
}

static void copy(char *to, size_t size, const char *from) {
    snprintf(to, size, "%s", from ? from : "");
}

static void add_fail(struct fail **fails, int *n, const char *name, int code) {
    *fails = realloc(*fails, sizeof(**fails) * (size_t)(*n + 1));
    copy((*fails)[*n].name, sizeof((*fails)[*n].name), name);
    (*fails)[*n].code = code;
    (*n)++;
}

static int kind_of(const char *letter) {
    return *letter == 'G' ? GRAPHICS : *letter == 'M' ? MPS : COMPUTE;
}

static int parse_error(const char *path, int line, const char *what) {
    fprintf(stderr, "fake libnvidia-ml: %s:%d: %s\n", path, line, what);
    return -1;
}

/* A number of the scenario (decimal, or 0x hex); "-" where allowed stands for a value NVML lacks. */
static int number(const char *t, unsigned long long *v) {
    char *end = NULL;
    *v = *t == '-' ? (unsigned long long)strtoll(t, &end, 0) : strtoull(t, &end, 0);
    return end && end != t && !*end ? 0 : -1;
}

static int optional(const char *t, int *has, unsigned long long *v) {
    if (!strcmp(t, "-")) { *has = 0; *v = 0; return 0; }
    *has = 1;
    return number(t, v);
}

#define NUMBERS(first, count, out) \
    do { for (int i_ = 0; i_ < (count); i_++) if (number(tok[(first) + i_], &(out)[i_])) return -1; } while (0)

/* A line of FakeHealth (a card's) or sram_unc (a MIG device's): 1 read, 0 not such a line, -1 bad. */
static int health_line(struct fake_dev *d, char **tok, int n) {
    const char *k = tok[0];
    struct health *h = &d->health;
    unsigned long long v[8] = {0};
    if (d->slot >= 0) {
        if (strcmp(k, "sram_unc")) return 0;
        if (n != 2 || number(tok[1], &d->sram_unc)) return -1;
        d->has_sram_unc = 1;
        return 1;
    }
    if (!strcmp(k, "field") && n == 4) { /* ID VALUE_TYPE VALUE */
        NUMBERS(1, 3, v);
        h->fields = realloc(h->fields, sizeof(*h->fields) * (size_t)(h->nfields + 1));
        h->fields[h->nfields++] = (struct field){(unsigned int)v[0], (int)v[1], NVML_SUCCESS, 1, v[2]};
    } else if (!strcmp(k, "field_error") && n == 3) { /* ID CODE: that entry's nvmlReturn */
        NUMBERS(1, 2, v);
        h->fields = realloc(h->fields, sizeof(*h->fields) * (size_t)(h->nfields + 1));
        h->fields[h->nfields++] = (struct field){(unsigned int)v[0], 0, (int)v[1], 0, 0};
    } else if (!strcmp(k, "threshold") && n == 3) {
        NUMBERS(1, 2, v);
        if (v[0] >= NVML_TEMPERATURE_THRESHOLD_COUNT) return -1;
        h->has_threshold[v[0]] = 1; h->threshold[v[0]] = (unsigned int)v[1];
    } else if (!strcmp(k, "margin") && n == 2) {
        NUMBERS(1, 1, v);
        h->has_margin = 1; h->margin = (int)(long long)v[0];
    } else if (!strcmp(k, "clock_events") && n == 3) {
        if (optional(tok[1], &h->has_reasons, &h->reasons)) return -1;
        if (optional(tok[2], &h->has_supported_reasons, &h->supported_reasons)) return -1;
    } else if (!strcmp(k, "pstate") && n == 2) {
        NUMBERS(1, 1, v);
        h->has_pstate = 1; h->pstate = (unsigned int)v[0];
    } else if ((!strcmp(k, "clock") || !strcmp(k, "max_clock")) && n == 3) {
        NUMBERS(1, 2, v);
        if (v[0] >= NVML_CLOCK_COUNT) return -1;
        int max = k[0] == 'm';
        (max ? h->has_max_clock : h->has_clock)[v[0]] = 1;
        (max ? h->max_clock : h->clock)[v[0]] = (unsigned int)v[1];
    } else if (!strcmp(k, "fan") && n == 2) {
        NUMBERS(1, 1, v);
        h->has_fan = 1; h->fan = (unsigned int)v[0];
    } else if (!strcmp(k, "power_limits") && n == 6) {
        for (int i = 0; i < 5; i++) {
            if (optional(tok[1 + i], &h->has_limit[i], &v[i])) return -1;
            h->limit[i] = (unsigned int)v[i];
        }
    } else if (!strcmp(k, "ecc_mode") && n == 3) {
        NUMBERS(1, 2, v);
        h->has_ecc_mode = 1; h->ecc_current = (unsigned int)v[0]; h->ecc_pending = (unsigned int)v[1];
    } else if (!strcmp(k, "ecc") && n == 5) { /* ERROR_TYPE COUNTER_TYPE LOCATION COUNT */
        NUMBERS(1, 4, v);
        if (v[0] > 1 || v[1] > 1 || v[2] >= NVML_MEMORY_LOCATION_COUNT) return -1;
        h->has_ecc[v[0]][v[1]][v[2]] = 1; h->ecc[v[0]][v[1]][v[2]] = v[3];
    } else if (!strcmp(k, "sram") && n == 8) { /* VP VS VC AP AS AC THRESHOLD_EXCEEDED */
        NUMBERS(1, 7, v);
        h->has_sram = 1;
        memcpy(h->sram, v, sizeof h->sram);
        h->sram_threshold = (unsigned int)v[6];
    } else if (!strcmp(k, "remapped") && n == 5) {
        NUMBERS(1, 4, v);
        h->has_remapped = 1;
        for (int i = 0; i < 4; i++) h->remapped[i] = (unsigned int)v[i];
    } else if (!strcmp(k, "histogram") && n == 6) {
        NUMBERS(1, 5, v);
        h->has_histogram = 1;
        for (int i = 0; i < 5; i++) h->histogram[i] = (unsigned int)v[i];
    } else if (!strcmp(k, "retired") && n >= 2) { /* CAUSE ADDRESS...: lines of one cause append */
        NUMBERS(1, 1, v);
        if (v[0] >= NVML_PAGE_RETIREMENT_CAUSE_COUNT) return -1;
        struct pages *p = &h->retired[v[0]];
        h->has_retired = 1;
        p->v = realloc(p->v, sizeof(*p->v) * (size_t)(p->n + (unsigned int)n));
        for (int i = 2; i < n; i++)
            if (number(tok[i], &p->v[p->n++])) return -1;
    } else if (!strcmp(k, "retired_pending") && n == 2) {
        NUMBERS(1, 1, v);
        h->has_retired_pending = 1; h->retired_pending = (unsigned int)v[0];
    } else if (!strcmp(k, "repair") && n == 3) {
        NUMBERS(1, 2, v);
        h->has_repair = 1; h->repair_channel = (unsigned int)v[0]; h->repair_tpc = (unsigned int)v[1];
    } else if (!strcmp(k, "unrepairable") && n == 2) {
        NUMBERS(1, 1, v);
        h->has_unrepairable = 1; h->unrepairable = (unsigned int)v[0];
    } else if (!strcmp(k, "pcie_link") && n == 5) {
        NUMBERS(1, 4, v);
        h->has_link = 1;
        for (int i = 0; i < 4; i++) h->link[i] = (unsigned int)v[i];
    } else if (!strcmp(k, "serial") && n == 2) {
        copy(d->serial, sizeof d->serial, tok[1]);
        d->has_serial = 1;
    } else if (!strcmp(k, "sram_unc")) {
        return -1; /* a MIG device's */
    } else {
        return 0;
    }
    return 1;
}

static int xid_line(char **tok); /* a queued XID event: the XID events' region, below */
/* A line of a card's activity (the GPM region, below): 1 read, 0 not such a line, -1 bad. */
static int activity_line(struct activity *a, char **tok, int n);
/* A wall_clock line (the GPM region, below): 0 read, -1 bad. */
static int wall_clock_line(char **tok);
static char clock_file[4096]; /* the fake clock's file (scenario line clock_file), read at each sample */

#define MAX_WORDS 40

static int load(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return parse_error(path, 0, "cannot open the scenario");
    char buf[4096];
    int line = 0, cur = -1;
    while (fgets(buf, sizeof buf, f)) {
        line++;
        char *save = NULL, *tok[MAX_WORDS] = {0};
        int n = 0, health;
        for (char *t = strtok_r(buf, " \t\r\n", &save); t; t = strtok_r(NULL, " \t\r\n", &save)) {
            if (n == MAX_WORDS && tok[0][0] == '#') break;
            if (n == MAX_WORDS) return fclose(f), parse_error(path, line, "too many words");
            tok[n++] = t;
        }
        if (n == 0 || tok[0][0] == '#') continue;
        for (int i = 1; i < n; i++) unescape(tok[i]);
        const char *k = tok[0];
        struct fake_dev *d = cur >= 0 ? &devs[cur] : NULL;
        if (!strcmp(k, "driver") && n == 2) copy(driver_version, sizeof driver_version, tok[1]);
        else if (!strcmp(k, "nvml_version") && n == 2) copy(nvml_version, sizeof nvml_version, tok[1]);
        else if (!strcmp(k, "cuda") && n == 2) cuda_version = atoi(tok[1]);
        else if (!strcmp(k, "init_error") && n == 2) init_error = atoi(tok[1]);
        else if (!strcmp(k, "r535_struct_mismatch") && n == 1) r535 = 1;
        else if (!strcmp(k, "system_error") && n == 3) add_fail(&sys_fails, &nsys_fails, tok[1], atoi(tok[2]));
        else if (!strcmp(k, "hang") && n == 3) { copy(hang_function, sizeof hang_function, tok[1]); hang_after = atol(tok[2]); }
        else if (!strcmp(k, "xid") && n == 6) { if (xid_line(tok)) return fclose(f), parse_error(path, line, "bad xid"); }
        else if (!strcmp(k, "clock_file") && n == 2) copy(clock_file, sizeof clock_file, tok[1]);
        else if (!strcmp(k, "wall_clock") && n == 3) {
            if (wall_clock_line(tok)) return fclose(f), parse_error(path, line, "bad wall_clock");
        }
        else if (!strcmp(k, "process_name") && n == 3) {
            pnames = realloc(pnames, sizeof(*pnames) * (size_t)(npnames + 1));
            pnames[npnames].pid = (unsigned int)strtoul(tok[1], NULL, 10);
            pnames[npnames].name = strdup(tok[2]);
            npnames++;
        } else if ((!strcmp(k, "card") && n == 1) || (!strcmp(k, "mig") && n == 6)) {
            int slot = n == 6 ? atoi(tok[1]) : -1;
            if (slot >= 0 && (ncards == 0 || slot >= MAX_SLOTS)) return fclose(f), parse_error(path, line, "bad mig");
            devs = realloc(devs, sizeof(*devs) * (size_t)(ndevs + 1));
            d = &devs[ndevs];
            memset(d, 0, sizeof *d);
            for (int i = 0; i < MAX_SLOTS; i++) d->mig_dev[i] = -1;
            d->slot = slot;
            if (slot < 0) {
                card_dev = realloc(card_dev, sizeof(int) * (size_t)(ncards + 1));
                card_dev[ncards] = ndevs;
                d->card = ncards++;
            } else {
                struct fake_dev *card = &devs[card_dev[ncards - 1]];
                d->card = ncards - 1;
                card->mig_dev[slot] = ndevs;
                d->gi = (unsigned int)atoi(tok[2]);
                d->ci = (unsigned int)atoi(tok[3]);
                copy(d->profile, sizeof d->profile, tok[4]);
                copy(d->uuid, sizeof d->uuid, tok[5]);
            }
            cur = ndevs++;
        } else if (!d) {
            return fclose(f), parse_error(path, line, "a device line before any card");
        } else if (!strcmp(k, "name") && n == 2) copy(d->name, sizeof d->name, tok[1]);
        else if (!strcmp(k, "uuid") && n == 2) copy(d->uuid, sizeof d->uuid, tok[1]);
        else if (!strcmp(k, "pci") && n == 4) {
            copy(d->bus, sizeof d->bus, tok[1]);
            d->pci_device_id = (unsigned int)strtoul(tok[2], NULL, 0);
            d->pci_subsystem_id = (unsigned int)strtoul(tok[3], NULL, 0);
        } else if (!strcmp(k, "memory") && n == 5) {
            d->has_memory = 1;
            d->total = strtoull(tok[1], NULL, 10); d->reserved = strtoull(tok[2], NULL, 10);
            d->used = strtoull(tok[3], NULL, 10); d->free = strtoull(tok[4], NULL, 10);
        } else if (!strcmp(k, "mig_mode") && n == 3) {
            d->has_mig_mode = 1; d->mig_current = atoi(tok[1]); d->mig_pending = atoi(tok[2]);
        } else if (!strcmp(k, "temperature") && n == 2) { d->has_temperature = 1; d->temperature = (unsigned int)atoi(tok[1]); }
        else if (!strcmp(k, "power") && n == 2) { d->has_power = 1; d->power_mw = (unsigned int)strtoul(tok[1], NULL, 10); }
        else if (!strcmp(k, "utilization") && n == 3) {
            d->has_util = 1; d->util_gpu = (unsigned int)atoi(tok[1]); d->util_memory = (unsigned int)atoi(tok[2]);
        } else if (!strcmp(k, "max_mig") && n == 2) d->max_mig = (unsigned int)atoi(tok[1]);
        else if (!strcmp(k, "error") && n == 3) add_fail(&d->fails, &d->nfails, tok[1], atoi(tok[2]));
        else if (!strcmp(k, "grow") && n == 3) d->grow[kind_of(tok[1])] = (unsigned int)atoi(tok[2]);
        else if (!strcmp(k, "process") && n == 4) {
            struct plist *l = &d->lists[kind_of(tok[1])];
            if (l->n == l->cap) { l->cap = l->cap ? 2 * l->cap : 16; l->v = realloc(l->v, sizeof(*l->v) * l->cap); }
            l->v[l->n].pid = (unsigned int)strtoul(tok[2], NULL, 10);
            l->v[l->n].used = !strcmp(tok[3], "-") ? UNKNOWN_MEMORY : strtoull(tok[3], NULL, 10);
            l->n++;
        } else if ((health = health_line(d, tok, n)) != 0) {
            if (health < 0) return fclose(f), parse_error(path, line, "bad health line");
        } else if ((health = activity_line(&devs[card_dev[d->card]].activity, tok, n)) != 0) {
            if (health < 0) return fclose(f), parse_error(path, line, "bad activity line");
        } else {
            return fclose(f), parse_error(path, line, "unknown line");
        }
    }
    fclose(f);
    return 0;
}

/* ---- plumbing ---- */

static void maybe_hang(const char *function) {
    if (!hang_function[0] || strcmp(function, hang_function)) return;
    if (__atomic_fetch_sub(&hang_after, 1, __ATOMIC_SEQ_CST) > 0) return;
    for (;;) sleep(3600); /* a call that never returns, as a wedged driver's */
}

static int fail_code(const struct fail *fails, int n, const char *function) {
    int star = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(fails[i].name, function)) return fails[i].code;
        if (!strcmp(fails[i].name, "*")) star = fails[i].code;
    }
    return star;
}

static int system_call(const char *function) {
    maybe_hang(function);
    if (__atomic_load_n(&init_count, __ATOMIC_SEQ_CST) <= 0) return NVML_ERROR_UNINITIALIZED;
    return fail_code(sys_fails, nsys_fails, function);
}

static struct fake_dev *resolve(nvmlDevice_t h) {
    if (!devs || h < devs || h >= devs + ndevs) return NULL;
    if (((const char *)h - (const char *)devs) % (ptrdiff_t)sizeof(*devs)) return NULL;
    return h;
}

static struct fake_dev *card_of(const struct fake_dev *d) { return &devs[card_dev[d->card]]; }

/* The handle's device, after init and the scenario's injected errors (the card's, then the MIG device's). */
static int device_call(const char *function, nvmlDevice_t h, struct fake_dev **out) {
    maybe_hang(function);
    if (__atomic_load_n(&init_count, __ATOMIC_SEQ_CST) <= 0) return NVML_ERROR_UNINITIALIZED;
    struct fake_dev *d = resolve(h);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_dev *card = card_of(d);
    int code = fail_code(card->fails, card->nfails, function);
    if (!code && d != card) code = fail_code(d->fails, d->nfails, function);
    if (code) return code;
    *out = d;
    return NVML_SUCCESS;
}

#define DEVICE(function, h) \
    struct fake_dev *d = NULL; \
    do { int rc_ = device_call(function, h, &d); if (rc_) return rc_; } while (0)

static int mig_enabled(const struct fake_dev *card) { return card->has_mig_mode && card->mig_current; }

static nvmlReturn_t write_string(char *buf, unsigned int length, const char *text) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(text) + 1;
    if (n > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, text, n);
    return NVML_SUCCESS;
}

static nvmlReturn_t write_uint(unsigned int *out, unsigned int value) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = value;
    return NVML_SUCCESS;
}

/* ---- system ---- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (!loaded) {
        const char *path = getenv("FAKE_NVML_SCENARIO");
        if (!path || !*path) {
            fprintf(stderr, "fake libnvidia-ml: FAKE_NVML_SCENARIO is not set\n");
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_DRIVER_NOT_LOADED;
        }
        if (load(path)) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_UNKNOWN;
        }
        loaded = 1;
    }
    int rc = init_error;
    if (!rc) __atomic_add_fetch(&init_count, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&lock);
    return rc;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    int rc = init_count <= 0 ? NVML_ERROR_UNINITIALIZED : NVML_SUCCESS;
    if (!rc) __atomic_sub_fetch(&init_count, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&lock);
    return rc;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t code) {
    switch (code) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    int rc = system_call("nvmlSystemGetDriverVersion");
    return rc ? rc : write_string(version, length, driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    int rc = system_call("nvmlSystemGetNVMLVersion");
    return rc ? rc : write_string(version, length, nvml_version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    int rc = system_call("nvmlSystemGetCudaDriverVersion");
    if (rc) return rc;
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = cuda_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    int rc = system_call("nvmlSystemGetCudaDriverVersion_v2");
    if (rc) return rc;
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = cuda_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length) {
    int rc = system_call("nvmlSystemGetProcessName");
    if (rc) return rc;
    for (int i = 0; i < npnames; i++)
        if (pnames[i].pid == pid) return write_string(name, length, pnames[i].name);
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    int rc = system_call("nvmlDeviceGetCount_v2");
    return rc ? rc : write_uint(count, (unsigned int)ncards);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    int rc = system_call("nvmlDeviceGetHandleByIndex_v2");
    if (rc) return rc;
    if (!device || index >= (unsigned int)ncards) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_dev *card = &devs[card_dev[index]];
    /* fails only when named: a lost card still gives out its handle */
    for (int i = 0; i < card->nfails; i++)
        if (!strcmp(card->fails[i].name, "nvmlDeviceGetHandleByIndex_v2")) return card->fails[i].code;
    *device = card;
    return NVML_SUCCESS;
}

/* ---- identity ---- */

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE("nvmlDeviceGetIndex", device);
    if (d->slot >= 0) return NVML_ERROR_NOT_SUPPORTED; /* as the Python fake: no NVML index of its own */
    return write_uint(index, (unsigned int)d->card);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE("nvmlDeviceGetName", device);
    if (d->slot < 0) return write_string(name, length, d->name);
    char full[256];
    snprintf(full, sizeof full, "%s MIG %s", card_of(d)->name, d->profile);
    return write_string(name, length, full);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE("nvmlDeviceGetUUID", device);
    return write_string(uuid, length, d->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE("nvmlDeviceGetPciInfo_v3", device);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_dev *card = card_of(d); /* a MIG handle answers its parent's identity */
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(card->bus, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    memset(pci, 0, sizeof *pci);
    pci->domain = domain; pci->bus = bus; pci->device = dev;
    pci->pciDeviceId = card->pci_device_id;
    pci->pciSubSystemId = card->pci_subsystem_id;
    copy(pci->busId, sizeof pci->busId, card->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, dev, fn);
    return NVML_SUCCESS;
}

/* ---- MIG ---- */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    DEVICE("nvmlDeviceGetMigMode", device);
    if (d->slot >= 0 || !d->has_mig_mode) return NVML_ERROR_NOT_SUPPORTED;
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = (unsigned int)d->mig_current;
    *pending = (unsigned int)d->mig_pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    DEVICE("nvmlDeviceGetMaxMigDeviceCount", device);
    if (d->slot >= 0) return NVML_ERROR_INVALID_ARGUMENT;
    return write_uint(count, mig_enabled(d) ? d->max_mig : 0); /* "zero if MIG is not supported or enabled" */
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    DEVICE("nvmlDeviceGetMigDeviceHandleByIndex", device);
    if (d->slot >= 0 || !mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_enabled(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= d->max_mig || index >= MAX_SLOTS) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->mig_dev[index] < 0) return NVML_ERROR_NOT_FOUND;
    *mig = &devs[d->mig_dev[index]];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMig) {
    DEVICE("nvmlDeviceIsMigDeviceHandle", device);
    return write_uint(isMig, d->slot >= 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t device, nvmlDevice_t *card) {
    DEVICE("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", device);
    if (d->slot < 0 || !card) return NVML_ERROR_INVALID_ARGUMENT;
    *card = card_of(d);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEVICE("nvmlDeviceGetGpuInstanceId", device);
    return d->slot < 0 ? NVML_ERROR_NOT_SUPPORTED : write_uint(id, d->gi);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEVICE("nvmlDeviceGetComputeInstanceId", device);
    return d->slot < 0 ? NVML_ERROR_NOT_SUPPORTED : write_uint(id, d->ci);
}

/* ---- readings ---- */

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    DEVICE("nvmlDeviceGetTemperature", device);
    if (sensor != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0 || !d->has_temperature) return NVML_ERROR_NOT_SUPPORTED;
    return write_uint(temp, d->temperature);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE("nvmlDeviceGetPowerUsage", device);
    if (d->slot >= 0 || !d->has_power) return NVML_ERROR_NOT_SUPPORTED;
    return write_uint(power, d->power_mw);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    DEVICE("nvmlDeviceGetUtilizationRates", device);
    if (d->slot >= 0 || mig_enabled(d) || !d->has_util) return NVML_ERROR_NOT_SUPPORTED;
    if (!util) return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = d->util_gpu;
    util->memory = d->util_memory;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE("nvmlDeviceGetMemoryInfo", device);
    if (!d->has_memory) return NVML_ERROR_NOT_SUPPORTED;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    /* v1 has no "reserved": its used is reserved + allocated */
    memory->total = d->total; memory->free = d->free; memory->used = d->reserved + d->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEVICE("nvmlDeviceGetMemoryInfo_v2", device);
    if (!d->has_memory) return NVML_ERROR_NOT_SUPPORTED;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = d->total; memory->reserved = d->reserved; memory->used = d->used; memory->free = d->free;
    return NVML_SUCCESS;
}

/* ---- card health (sources/nvml_health.py), from the card's FakeHealth: a value it lacks answers
 * NOT_SUPPORTED, checked before the output pointer as in the Python fake; a MIG handle answers
 * NOT_SUPPORTED, but for its own ECC counter and its (empty) field values ---- */

static int card_only(const struct fake_dev *d) { return d->slot >= 0 ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS; }

/* A card-level call: DEVICE, then NOT_SUPPORTED on a MIG handle; `h` is the card's health. */
#define HEALTH(function, h_) \
    DEVICE(function, h_); \
    if (card_only(d)) return NVML_ERROR_NOT_SUPPORTED; \
    const struct health *h = &d->health

static nvmlReturn_t write_ull(unsigned long long *out, unsigned long long value) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = value;
    return NVML_SUCCESS;
}

static nvmlReturn_t given_uint(int has, unsigned int *out, unsigned int value) {
    return has ? write_uint(out, value) : NVML_ERROR_NOT_SUPPORTED;
}

static nvmlReturn_t given_ull(int has, unsigned long long *out, unsigned long long value) {
    return has ? write_ull(out, value) : NVML_ERROR_NOT_SUPPORTED;
}

/* A field's answer: its value (if any), and its own nvmlReturn (field_errors over fields). */
static int field_answer(const struct health *h, unsigned int id, const struct field **value) {
    int code = NVML_ERROR_NOT_SUPPORTED, error = -1;
    *value = NULL;
    for (int i = 0; i < h->nfields; i++) {
        if (h->fields[i].id != id) continue;
        if (h->fields[i].has_value) *value = &h->fields[i];
        else error = h->fields[i].code;
    }
    if (*value) code = NVML_SUCCESS;
    return error >= 0 ? error : code;
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    DEVICE("nvmlDeviceGetFieldValues", device);
    if (!values || count <= 0) return NVML_ERROR_INVALID_ARGUMENT;
    static const struct health none; /* a MIG handle supports no field */
    const struct health *h = d->slot >= 0 ? &none : &d->health;
    for (int i = 0; i < count; i++) { /* the call succeeds; each entry carries its own answer */
        const struct field *f;
        values[i].nvmlReturn = field_answer(h, values[i].fieldId, &f);
        if (values[i].nvmlReturn != NVML_SUCCESS || !f) continue;
        values[i].valueType = f->type;
        if (f->type == NVML_VALUE_TYPE_UNSIGNED_INT) values[i].value.uiVal = (unsigned int)f->value;
        else values[i].value.ullVal = f->value;
    }
    return NVML_SUCCESS;
}

static const struct field *field_value(const struct health *h, unsigned int id) {
    for (int i = 0; i < h->nfields; i++)
        if (h->fields[i].id == id && h->fields[i].has_value) return &h->fields[i];
    return NULL;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    HEALTH("nvmlDeviceGetTotalEnergyConsumption", device);
    const struct field *f = field_value(h, NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION);
    return given_ull(f != NULL, energy, f ? f->value : 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    HEALTH("nvmlDeviceGetPcieReplayCounter", device);
    const struct field *f = field_value(h, NVML_FI_DEV_PCIE_REPLAY_COUNTER);
    return given_uint(f != NULL, value, f ? (unsigned int)f->value : 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, int threshold, unsigned int *temp) {
    HEALTH("nvmlDeviceGetTemperatureThreshold", device);
    if ((unsigned int)threshold >= NVML_TEMPERATURE_THRESHOLD_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    return given_uint(h->has_threshold[threshold], temp, h->threshold[threshold]);
}

EXPORT nvmlReturn_t nvmlDeviceGetMarginTemperature(nvmlDevice_t device, nvmlMarginTemperature_v1_t *margin) {
    HEALTH("nvmlDeviceGetMarginTemperature", device);
    if (!margin) return NVML_ERROR_INVALID_ARGUMENT;
    if (margin->version != nvmlMarginTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!h->has_margin) return NVML_ERROR_NOT_SUPPORTED;
    margin->marginTemperature = h->margin;
    return NVML_SUCCESS;
}

#define REASONS(Name, has, value)                                                         \
    EXPORT nvmlReturn_t nvmlDeviceGet##Name(nvmlDevice_t device, unsigned long long *reasons) { \
        HEALTH("nvmlDeviceGet" #Name, device);                                           \
        return given_ull(h->has, reasons, h->value);                                     \
    }

REASONS(CurrentClocksEventReasons, has_reasons, reasons)
REASONS(SupportedClocksEventReasons, has_supported_reasons, supported_reasons)
REASONS(CurrentClocksThrottleReasons, has_reasons, reasons) /* the pre-535 names */
REASONS(SupportedClocksThrottleReasons, has_supported_reasons, supported_reasons)

EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *pstate) {
    HEALTH("nvmlDeviceGetPerformanceState", device);
    return given_uint(h->has_pstate, (unsigned int *)pstate, h->pstate);
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    HEALTH("nvmlDeviceGetClockInfo", device);
    if ((unsigned int)type >= NVML_CLOCK_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    return given_uint(h->has_clock[type], clock, h->clock[type]);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    HEALTH("nvmlDeviceGetMaxClockInfo", device);
    if ((unsigned int)type >= NVML_CLOCK_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    return given_uint(h->has_max_clock[type], clock, h->max_clock[type]);
}

EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed) {
    HEALTH("nvmlDeviceGetFanSpeed", device);
    return given_uint(h->has_fan, speed, h->fan);
}

#define LIMIT(Name, i)                                                                 \
    EXPORT nvmlReturn_t nvmlDeviceGet##Name(nvmlDevice_t device, unsigned int *limit) { \
        HEALTH("nvmlDeviceGet" #Name, device);                                        \
        return given_uint(h->has_limit[i], limit, h->limit[i]);                       \
    }

LIMIT(EnforcedPowerLimit, 0)
LIMIT(PowerManagementLimit, 1)
LIMIT(PowerManagementDefaultLimit, 2)

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit,
                                                                 unsigned int *maxLimit) {
    HEALTH("nvmlDeviceGetPowerManagementLimitConstraints", device);
    if (!minLimit || !maxLimit) return NVML_ERROR_INVALID_ARGUMENT;
    if (!h->has_limit[3]) return NVML_ERROR_NOT_SUPPORTED;
    *minLimit = h->limit[3];
    return given_uint(h->has_limit[4], maxLimit, h->limit[4]);
}

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending) {
    HEALTH("nvmlDeviceGetEccMode", device);
    if (!h->has_ecc_mode) return NVML_ERROR_NOT_SUPPORTED;
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = (int)h->ecc_current;
    *pending = (int)h->ecc_pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t device, int errorType, int counterType,
                                                    int locationType, unsigned long long *count) {
    DEVICE("nvmlDeviceGetMemoryErrorCounter", device);
    unsigned int e = (unsigned int)errorType, c = (unsigned int)counterType, l = (unsigned int)locationType;
    if (e > 1 || c > 1 || l >= NVML_MEMORY_LOCATION_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0) /* a MIG handle counts only its own volatile uncorrectable SRAM errors */
        return given_ull(d->has_sram_unc && e == NVML_MEMORY_ERROR_TYPE_UNCORRECTED && c == NVML_VOLATILE_ECC
                             && l == NVML_MEMORY_LOCATION_SRAM, count, d->sram_unc);
    const struct health *h = &d->health;
    if (!h->has_ecc_mode || !h->ecc_current) return NVML_ERROR_NOT_SUPPORTED; /* nothing counted while ECC is off */
    return given_ull(h->has_ecc[e][c][l], count, h->ecc[e][c][l]);
}

EXPORT nvmlReturn_t nvmlDeviceGetSramEccErrorStatus(nvmlDevice_t device, nvmlEccSramErrorStatus_v1_t *status) {
    HEALTH("nvmlDeviceGetSramEccErrorStatus", device);
    if (!h->has_sram) return NVML_ERROR_NOT_SUPPORTED;
    if (!status) return NVML_ERROR_INVALID_ARGUMENT;
    if (status->version != nvmlEccSramErrorStatus_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    status->volatileUncParity = h->sram[0]; status->volatileUncSecDed = h->sram[1]; status->volatileCor = h->sram[2];
    status->aggregateUncParity = h->sram[3]; status->aggregateUncSecDed = h->sram[4]; status->aggregateCor = h->sram[5];
    status->bThresholdExceeded = h->sram_threshold;
    return NVML_SUCCESS;
}

/* The row remapper: card-level, and not supported in MIG mode (NVML). */
#define REMAPPER(function, has) \
    HEALTH(function, device); \
    if (mig_enabled(d) || !h->has) return NVML_ERROR_NOT_SUPPORTED

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred) {
    REMAPPER("nvmlDeviceGetRemappedRows", has_remapped);
    unsigned int *out[4] = {corrRows, uncRows, isPending, failureOccurred};
    for (int i = 0; i < 4; i++)
        if (!out[i]) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < 4; i++) *out[i] = h->remapped[i];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRowRemapperHistogram(nvmlDevice_t device, nvmlRowRemapperHistogramValues_t *values) {
    REMAPPER("nvmlDeviceGetRowRemapperHistogram", has_histogram);
    if (!values) return NVML_ERROR_INVALID_ARGUMENT;
    values->max = h->histogram[0]; values->high = h->histogram[1]; values->partial = h->histogram[2];
    values->low = h->histogram[3]; values->none = h->histogram[4];
    return NVML_SUCCESS;
}

/* nvml.h: a count too small (0, with a NULL array, to ask the size) answers INSUFFICIENT_SIZE and the
 * count. pynvml sizes with four arguments and reads with five: `timestamps` is read only when
 * `addresses` is given, as a caller of the four-argument form leaves it undefined. */
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause, unsigned int *pageCount,
                                                 unsigned long long *addresses, unsigned long long *timestamps) {
    HEALTH("nvmlDeviceGetRetiredPages_v2", device);
    if (!h->has_retired) return NVML_ERROR_NOT_SUPPORTED;
    if (!pageCount || (unsigned int)cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    const struct pages *p = &h->retired[cause];
    if (!addresses || *pageCount < p->n) {
        *pageCount = p->n;
        return p->n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    *pageCount = p->n;
    for (unsigned int i = 0; i < p->n; i++) {
        addresses[i] = p->v[i];
        if (timestamps) timestamps[i] = RETIRED_AT + i;
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending) {
    HEALTH("nvmlDeviceGetRetiredPagesPendingStatus", device);
    return given_uint(h->has_retired_pending, (unsigned int *)isPending, h->retired_pending);
}

EXPORT nvmlReturn_t nvmlDeviceGetRepairStatus(nvmlDevice_t device, nvmlRepairStatus_v1_t *status) {
    HEALTH("nvmlDeviceGetRepairStatus", device);
    if (!h->has_repair) return NVML_ERROR_NOT_SUPPORTED;
    if (!status) return NVML_ERROR_INVALID_ARGUMENT;
    if (status->version != nvmlRepairStatus_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    status->bChannelRepairPending = h->repair_channel;
    status->bTpcRepairPending = h->repair_tpc;
    return NVML_SUCCESS;
}

/* ---- other readings: nvitop-exporter's; every card answers the same H100-like values and a MIG
 * handle NOT_SUPPORTED, as in the Python fake ---- */

/* nvml.h (590+): nvmlUnrepairableMemory_v1_t, version NVML_STRUCT_VERSION(UnrepairableMemory, 1). */
typedef struct { unsigned int version, unrepairableMemory; } nvmlUnrepairableMemory_v1_t;
#define nvmlUnrepairableMemory_v1 ((unsigned int)(sizeof(nvmlUnrepairableMemory_v1_t) | (1 << 24)))

EXPORT nvmlReturn_t nvmlDeviceGetUnrepairableMemoryFlag_v1(nvmlDevice_t device, nvmlUnrepairableMemory_v1_t *status) {
    HEALTH("nvmlDeviceGetUnrepairableMemoryFlag_v1", device);
    if (!h->has_unrepairable) return NVML_ERROR_NOT_SUPPORTED;
    if (!status) return NVML_ERROR_INVALID_ARGUMENT;
    if (status->version != nvmlUnrepairableMemory_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    status->unrepairableMemory = h->unrepairable;
    return NVML_SUCCESS;
}

#define LINK(Name, i) \
    EXPORT nvmlReturn_t nvmlDeviceGet##Name(nvmlDevice_t device, unsigned int *value) { \
        HEALTH("nvmlDeviceGet" #Name, device); \
        return given_uint(h->has_link, value, h->link[i]); \
    }
LINK(CurrPcieLinkGeneration, 0)
LINK(MaxPcieLinkGeneration, 1)
LINK(CurrPcieLinkWidth, 2)
LINK(MaxPcieLinkWidth, 3)

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    DEVICE("nvmlDeviceGetSerial", device);
    const struct fake_dev *card = card_of(d);
    return card->has_serial ? write_string(serial, length, card->serial) : NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temperature) {
    DEVICE("nvmlDeviceGetTemperatureV", device);
    if (!temperature) return NVML_ERROR_INVALID_ARGUMENT;
    if (temperature->version != nvmlTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0 || !d->has_temperature) return NVML_ERROR_NOT_SUPPORTED;
    temperature->temperature = (int)d->temperature;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *util, unsigned int *period) {
    DEVICE("nvmlDeviceGetEncoderUtilization", device);
    if (card_only(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (!period) return NVML_ERROR_INVALID_ARGUMENT;
    *period = 167000;
    return write_uint(util, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *util, unsigned int *period) {
    DEVICE("nvmlDeviceGetDecoderUtilization", device);
    if (card_only(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (!period) return NVML_ERROR_INVALID_ARGUMENT;
    *period = 167000;
    return write_uint(util, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned int *value) {
    DEVICE("nvmlDeviceGetPcieThroughput", device);
    if (card_only(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (counter == 0) return write_uint(value, 412); /* TX */
    if (counter == 1) return write_uint(value, 538); /* RX */
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* ---- processes ---- */

/* Synthetic pids of the entries a growing list gains: plausible, and in no scenario. */
#define GROWN_PID_BASE 3000000u

struct entry { unsigned int pid; unsigned long long used; unsigned int gi, ci; };

static unsigned int list_length(const struct fake_dev *d, int kind) {
    return d->lists[kind].n + (d->sized[kind] ? d->grow[kind] : 0);
}

static void list_entry(const struct fake_dev *d, int kind, unsigned int i, unsigned int gi, unsigned int ci,
                       struct entry *e) {
    if (i < d->lists[kind].n) {
        e->pid = d->lists[kind].v[i].pid;
        e->used = d->lists[kind].v[i].used;
    } else {
        e->pid = GROWN_PID_BASE + (unsigned int)d->card * 1000u + (unsigned int)(d->slot + 1) * 100u + i;
        e->used = 1024ull * 1024ull;
    }
    e->gi = gi;
    e->ci = ci;
}

/* What the handle lists: a card its own entries and then its MIG devices' by slot; a MIG device its own. */
static unsigned int entries(const struct fake_dev *d, int kind, struct entry *out, int v3) {
    unsigned int n = 0;
    const struct fake_dev *migs[MAX_SLOTS + 1];
    int nmigs = 0;
    if (d->slot < 0) {
        for (unsigned int i = 0; i < list_length(d, kind); i++, n++)
            if (out) list_entry(d, kind, i, NO_INSTANCE_ID, NO_INSTANCE_ID, &out[n]);
        for (int s = 0; s < MAX_SLOTS; s++)
            if (d->mig_dev[s] >= 0) migs[nmigs++] = &devs[d->mig_dev[s]];
    } else {
        migs[nmigs++] = d;
    }
    for (int m = 0; m < nmigs; m++)
        for (unsigned int i = 0; i < list_length(migs[m], kind); i++, n++)
            if (out) list_entry(migs[m], kind, i, migs[m]->gi, migs[m]->ci, &out[n]);
    if (v3 && r535) { /* each process becomes four entries: its pid, then 0, 4294967295, 4294967295 */
        if (out) {
            for (int i = (int)n - 1; i >= 0; i--) {
                struct entry e = out[i];
                unsigned int garbage[3] = {0, 0xFFFFFFFFu, 0xFFFFFFFFu};
                out[4 * i] = e;
                out[4 * i].used = R535_GARBAGE_BYTES;
                for (int g = 0; g < 3; g++)
                    out[4 * i + 1 + g] = (struct entry){garbage[g], R535_GARBAGE_BYTES, 0, 0};
            }
        }
        n *= 4;
    }
    return n;
}

static nvmlReturn_t process_list(const char *function, int kind, int version, nvmlDevice_t device,
                                 unsigned int *count, void *infos) {
    DEVICE(function, device);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock); /* a growing list changes under concurrent callers */
    unsigned int n = entries(d, kind, NULL, version == 3);
    if (!infos || *count < n) {
        *count = n;
        if (!infos) d->sized[kind] = 1; /* a list set to grow does so after its first sizing call */
        pthread_mutex_unlock(&lock);
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    struct entry *all = malloc(sizeof(*all) * (n ? n : 1));
    entries(d, kind, all, version == 3);
    pthread_mutex_unlock(&lock);
    *count = n;
    for (unsigned int i = 0; i < n; i++) {
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = all[i].pid; p->usedGpuMemory = all[i].used;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + i;
            p->pid = all[i].pid; p->usedGpuMemory = all[i].used;
            p->gpuInstanceId = all[i].gi; p->computeInstanceId = all[i].ci;
        }
    }
    free(all);
    return NVML_SUCCESS;
}

#define PROCESS_LIST(Kind, KIND)                                                                         \
    EXPORT nvmlReturn_t nvmlDeviceGet##Kind##RunningProcesses(nvmlDevice_t d, unsigned int *c, void *p) {    \
        return process_list("nvmlDeviceGet" #Kind "RunningProcesses", KIND, 1, d, c, p);                  \
    }                                                                                                    \
    EXPORT nvmlReturn_t nvmlDeviceGet##Kind##RunningProcesses_v2(nvmlDevice_t d, unsigned int *c, void *p) { \
        return process_list("nvmlDeviceGet" #Kind "RunningProcesses_v2", KIND, 2, d, c, p);               \
    }                                                                                                    \
    EXPORT nvmlReturn_t nvmlDeviceGet##Kind##RunningProcesses_v3(nvmlDevice_t d, unsigned int *c, void *p) { \
        return process_list("nvmlDeviceGet" #Kind "RunningProcesses_v3", KIND, 3, d, c, p);               \
    }

PROCESS_LIST(Compute, COMPUTE)
PROCESS_LIST(Graphics, GRAPHICS)
PROCESS_LIST(MPSCompute, MPS)

/* ---- XID events (src/mig_exporter/sources/xid.py): tests/fake_nvml.py's _FakeEvents ----
 * A scenario line "xid CARD XID GI CI AFTER_MS" (GI and CI "-": on no MIG instance) queues an XID,
 * delivered, in the file's order, to the first nvmlEventSetWait_v2 on a set where CARD is registered,
 * once AFTER_MS have passed since the scenario was read (at the first nvmlInit). A wait on a set
 * holding a card whose errors name nvmlEventSetWait_v2 (or *) answers that code; one with nothing
 * to deliver answers TIMEOUT after its timeout. A MIG handle cannot be registered (NOT_SUPPORTED). */

typedef struct {
    nvmlDevice_t device; unsigned long long eventType, eventData; unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
#define EVENT_TYPE_XID 0x8ull
#define SUPPORTED_EVENTS 0x1Full /* single- and double-bit ECC, P-state, XID, clock: the Python fake's */
#define EVENT_SET_MAGIC 0x58494453
#define MAX_EVENT_CARDS 64

struct event_set { int magic; int cards[MAX_EVENT_CARDS]; };
typedef struct event_set *nvmlEventSet_t;
struct xid_event { int card; unsigned long long xid; unsigned int gi, ci; long long at_ms; int delivered; };

static pthread_mutex_t event_lock = PTHREAD_MUTEX_INITIALIZER;
static struct xid_event *xid_events;
static int nxid_events;

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int instance_id(const char *t, unsigned int *id) {
    unsigned long long v = NO_INSTANCE_ID;
    if (strcmp(t, "-") && number(t, &v)) return -1;
    *id = (unsigned int)v;
    return 0;
}

static int xid_line(char **tok) {
    unsigned long long card, xid, after;
    struct xid_event e = {0};
    if (number(tok[1], &card) || number(tok[2], &xid) || number(tok[5], &after)) return -1;
    if (instance_id(tok[3], &e.gi) || instance_id(tok[4], &e.ci)) return -1;
    e.card = (int)card;
    e.xid = xid;
    e.at_ms = now_ms() + (long long)after;
    xid_events = realloc(xid_events, sizeof(*xid_events) * (size_t)(nxid_events + 1));
    xid_events[nxid_events++] = e;
    return 0;
}

static int event_set_ok(const struct event_set *set) { return set && set->magic == EVENT_SET_MAGIC; }

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    int rc = system_call("nvmlEventSetCreate");
    if (rc) return rc;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    if (!*set) return NVML_ERROR_UNKNOWN;
    (*set)->magic = EVENT_SET_MAGIC;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    int rc = system_call("nvmlEventSetFree");
    if (rc) return rc;
    if (!event_set_ok(set)) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    DEVICE("nvmlDeviceGetSupportedEventTypes", device);
    if (d->slot >= 0) return NVML_ERROR_NOT_SUPPORTED;
    if (!types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    DEVICE("nvmlDeviceRegisterEvents", device);
    if (d->slot >= 0 || types & ~SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    if (!event_set_ok(set) || d->card >= MAX_EVENT_CARDS) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&event_lock);
    set->cards[d->card] = 1;
    pthread_mutex_unlock(&event_lock);
    return NVML_SUCCESS;
}

/* The code a wait answers now (a registered card's injected error, or an event written), else -1. */
static int deliver(struct event_set *set, nvmlEventData_t *data) {
    for (int c = 0; c < ncards && c < MAX_EVENT_CARDS; c++) {
        int code = set->cards[c] ? fail_code(devs[card_dev[c]].fails, devs[card_dev[c]].nfails,
                                             "nvmlEventSetWait_v2") : 0;
        if (code) return code;
    }
    long long now = now_ms();
    for (int i = 0; i < nxid_events; i++) {
        struct xid_event *e = &xid_events[i];
        if (e->delivered || e->at_ms > now || e->card < 0 || e->card >= ncards || e->card >= MAX_EVENT_CARDS
            || !set->cards[e->card]) continue;
        e->delivered = 1;
        data->device = &devs[card_dev[e->card]];
        data->eventType = EVENT_TYPE_XID;
        data->eventData = e->xid;
        data->gpuInstanceId = e->gi;
        data->computeInstanceId = e->ci;
        return NVML_SUCCESS;
    }
    return -1;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    int rc = system_call("nvmlEventSetWait_v2");
    if (rc) return rc;
    if (!event_set_ok(set) || !data) return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        pthread_mutex_lock(&event_lock);
        rc = deliver(set, data);
        pthread_mutex_unlock(&event_lock);
        if (rc >= 0) return rc;
        long long left = deadline - now_ms();
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        usleep((useconds_t)(left < 10 ? left : 10) * 1000);
    }
}

/* ---- activity (src/mig_exporter/sources/nvml_activity.py): GPM and per-process utilisation ----
 * As tests/fake_nvml.py answers them (its "GPM" comment gives the choices where NVML's documentation
 * is silent; this library makes the same ones). A card's scenario lines (README.md) say whether it
 * has GPM, what the card as a whole and each of its GPU instances is busy with, from when on the
 * fake clock, which metrics fail, and which processes the driver sampled. A filled sample holds
 * whose counters it read and when; nvmlGpmMetricsGet answers each metric's scripted percent
 * integrated over the time between its two samples, divided by that time: a window of N seconds
 * at a scripted activity answers that activity, a script changed mid-window (a later "activity"
 * line, the Python fake's set_scenario) the mean over time. The Python fake keeps running
 * integrals instead; over one fixed script they are the same numbers. */

#define WHOLE_CARD (-1LL)
/* numMetrics above this (the smallest NVML_GPM_METRIC_MAX of any nvml.h, nvidia-ml-py 12.560's) fails. */
#define GPM_METRICS_MAX_OLDEST 98u
#define GPM_LAST_PERCENT_METRIC 13u /* ids 1-13 are percents and answer; any other NOT_SUPPORTED */
#define GPM_MIN_INTERVAL_S 0.1      /* samples closer answer 0 (NVML: "should be greater than 100ms") */

struct fake_gpm_sample { int filled, card; long long gi; double at_s; };

static pthread_mutex_t gpm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_gpm_sample **live_samples; /* allocated and not yet freed, so leaks show */
static int nlive_samples, live_capacity;
static int clock_is_set;   /* fakeNvmlSetClock was called: its value from then on */
static double clock_set_s, clock_file_s;

/* The fake clock in seconds: the value fakeNvmlSetClock set; else the number in the scenario's
 * clock_file, read at each sample (a file a test rewrites between calls; unreadable: its last
 * value, 0 at first); else CLOCK_MONOTONIC, as the Python fake's default (time.monotonic).
 * Called under gpm_lock. */
static double fake_now_s(void) {
    if (clock_is_set) return clock_set_s;
    if (clock_file[0]) {
        FILE *f = fopen(clock_file, "r");
        double v;
        if (f) {
            if (fscanf(f, "%lf", &v) == 1) clock_file_s = v;
            fclose(f);
        }
        return clock_file_s;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* For tests (tests/fake_nvml_c.py): hold the fake clock at `seconds`, over any clock_file. */
EXPORT void fakeNvmlSetClock(double seconds) {
    pthread_mutex_lock(&gpm_lock);
    clock_is_set = 1;
    clock_set_s = seconds;
    pthread_mutex_unlock(&gpm_lock);
}

/* For tests: GPM samples allocated and not freed (the Python fake's gpm_samples_held). */
EXPORT int fakeNvmlLiveGpmSamples(void) {
    pthread_mutex_lock(&gpm_lock);
    int n = nlive_samples;
    pthread_mutex_unlock(&gpm_lock);
    return n;
}

static int gpu_instance(const char *t, long long *gi) {
    unsigned long long v;
    if (!strcmp(t, "-")) { *gi = WHOLE_CARD; return 0; }
    if (number(t, &v) || v > 0xFFFFFFFFull) return -1;
    *gi = (long long)v;
    return 0;
}

static int decimal(const char *t, double *v) {
    char *end = NULL;
    *v = strtod(t, &end); /* nan and inf too: a script the exporter must leave out */
    return end && end != t && !*end ? 0 : -1;
}

/* Insert `item` into `array`[0:`count`] (grown by one) after every element that starts no later, so
 * the array stays ordered by from_s and a later line wins a tie. */
#define INSERT_BY_FROM(array, count, item) do {                                                       \
        int at_ = (count);                                                                              \
        while (at_ > 0 && (array)[at_ - 1].from_s > (item).from_s) at_--;                               \
        (array) = realloc((array), sizeof(*(array)) * (size_t)((count) + 1));                           \
        memmove(&(array)[at_ + 1], &(array)[at_], sizeof(*(array)) * (size_t)((count) - at_));         \
        (array)[at_] = (item);                                                                          \
        (count)++;                                                                                      \
    } while (0)

/* A FROM_S field: "-" since always, else a finite number of seconds; also in whole microseconds, as the
 * Python fake counts them (its set_scenario or step_wall_clock at T makes the samples up to
 * int(T x 1e6) before the change). 0, or -1 when it is neither. */
static int from_time(const char *t, double *from_s, long long *from_us) {
    if (!strcmp(t, "-")) {
        *from_s = -HUGE_VAL;
        *from_us = LLONG_MIN;
        return 0;
    }
    if (decimal(t, from_s) || !isfinite(*from_s)) return -1;
    *from_us = (long long)(*from_s * 1e6);
    return 0;
}

static int activity_line(struct activity *a, char **tok, int n) {
    const char *k = tok[0];
    unsigned long long v[6];
    if (!strcmp(k, "gpm") && n == 2) { /* 0/1 */
        NUMBERS(1, 1, v);
        a->gpm = v[0] != 0;
    } else if (!strcmp(k, "activity") && n == 5) { /* GI METRIC PERCENT FROM_S */
        struct gpm_step step;
        if (gpu_instance(tok[1], &step.gi) || number(tok[2], &v[0]) || decimal(tok[3], &step.percent)) return -1;
        step.metric = (unsigned int)v[0];
        if (!strcmp(tok[4], "-")) step.from_s = -HUGE_VAL; /* since always */
        else if (decimal(tok[4], &step.from_s)) return -1;
        INSERT_BY_FROM(a->steps, a->nsteps, step);
    } else if (!strcmp(k, "gpm_error") && n == 3) { /* METRIC CODE */
        NUMBERS(1, 2, v);
        a->fails = realloc(a->fails, sizeof(*a->fails) * (size_t)(a->nfails + 1));
        a->fails[a->nfails++] = (struct gpm_fail){(unsigned int)v[0], (int)v[1]};
    } else if (!strcmp(k, "gpu_instance") && n == 2) { /* GI: carved, with no compute instance */
        NUMBERS(1, 1, v);
        a->bare_gi = realloc(a->bare_gi, sizeof(*a->bare_gi) * (size_t)(a->nbare + 1));
        a->bare_gi[a->nbare++] = (unsigned int)v[0];
    } else if (!strcmp(k, "putil") && n == 7) { /* PID TIMESTAMP_US SM MEM ENC DEC */
        NUMBERS(1, 6, v);
        a->putil = realloc(a->putil, sizeof(*a->putil) * (size_t)(a->nputil + 1));
        a->putil[a->nputil++] = (struct putil){(unsigned int)v[0], v[1], (unsigned int)v[2], (unsigned int)v[3],
                                               (unsigned int)v[4], (unsigned int)v[5]};
    } else if (!strcmp(k, "pactivity") && n == 7) { /* PID SM MEM ENC DEC FROM_S */
        struct pscript s;
        NUMBERS(1, 5, v);
        s.pid = (unsigned int)v[0];
        for (int i = 0; i < 4; i++) s.share[i] = (unsigned int)v[i + 1];
        if (from_time(tok[6], &s.from_s, &s.from_us)) return -1;
        INSERT_BY_FROM(a->pscripts, a->npscripts, s);
    } else if (!strcmp(k, "putil_period") && n == 2) { /* US */
        NUMBERS(1, 1, v);
        if (!v[0]) return -1;
        a->period_us = v[0];
    } else if (!strcmp(k, "putil_merged") && n == 1) {
        a->merged = 1;
    } else {
        return 0;
    }
    return 1;
}

/* The scripted percent of `metric` on (card, gi) at time t: its last step starting at or before t;
 * 0 (idle) before its first. */
static double percent_at(const struct activity *a, long long gi, unsigned int metric, double t) {
    double percent = 0;
    for (int i = 0; i < a->nsteps && a->steps[i].from_s <= t; i++)
        if (a->steps[i].gi == gi && a->steps[i].metric == metric) percent = a->steps[i].percent;
    return percent;
}

/* ... integrated over [t1, t2], in percent-seconds. A NaN or Inf stretch counts nothing, as the
 * Python fake's counters skip it. */
static double busy_percent_s(const struct activity *a, long long gi, unsigned int metric, double t1, double t2) {
    double sum = 0;
    const struct gpm_step *cur = NULL;
    for (int i = 0; i <= a->nsteps; i++) {
        const struct gpm_step *next = i < a->nsteps ? &a->steps[i] : NULL;
        if (next && (next->gi != gi || next->metric != metric)) continue;
        if (cur && isfinite(cur->percent)) {
            double from = cur->from_s > t1 ? cur->from_s : t1;
            double to = next && next->from_s < t2 ? next->from_s : t2;
            if (to > from) sum += cur->percent * (to - from);
        }
        cur = next;
    }
    return sum;
}

/* The metric's own nvmlReturn: the scenario's gpm_error, else SUCCESS for a percent metric. */
static int gpm_metric_code(const struct activity *a, unsigned int metric) {
    for (int i = 0; i < a->nfails; i++)
        if (a->fails[i].metric == metric) return a->fails[i].code;
    return metric >= 1 && metric <= GPM_LAST_PERCENT_METRIC ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

/* The GPU instance has a compute instance on this card: a MIG device of it. */
static int has_compute_instance(const struct fake_dev *card, long long gi) {
    for (int s = 0; s < MAX_SLOTS; s++)
        if (card->mig_dev[s] >= 0 && devs[card->mig_dev[s]].gi == gi) return 1;
    return 0;
}

/* The GPU instance exists on this card: a MIG device (compute instance) of it, or one without. */
static int has_gpu_instance(const struct fake_dev *card, unsigned int gi) {
    if (has_compute_instance(card, gi)) return 1;
    for (int i = 0; i < card->activity.nbare; i++)
        if (card->activity.bare_gi[i] == gi) return 1;
    return 0;
}

static int live_index(const struct fake_gpm_sample *s) {
    for (int i = 0; s && i < nlive_samples; i++)
        if (live_samples[i] == s) return i;
    return -1;
}

EXPORT nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    int rc = system_call("nvmlGpmSampleAlloc");
    if (rc) return rc;
    if (!sample) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpm_sample *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_UNKNOWN;
    pthread_mutex_lock(&gpm_lock);
    if (nlive_samples == live_capacity) {
        live_capacity = live_capacity ? 2 * live_capacity : 64;
        live_samples = realloc(live_samples, sizeof(*live_samples) * (size_t)live_capacity);
    }
    live_samples[nlive_samples++] = s;
    pthread_mutex_unlock(&gpm_lock);
    *sample = s;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    int rc = system_call("nvmlGpmSampleFree");
    if (rc) return rc;
    pthread_mutex_lock(&gpm_lock);
    int i = live_index(sample);
    if (i >= 0) live_samples[i] = live_samples[--nlive_samples];
    pthread_mutex_unlock(&gpm_lock);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT; /* never allocated, or freed already */
    free(sample);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support) {
    DEVICE("nvmlGpmQueryDeviceSupport", device); /* a MIG handle answers as its card */
    if (!support) return NVML_ERROR_INVALID_ARGUMENT;
    if (support->version != NVML_GPM_SUPPORT_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    support->isSupportedDevice = (unsigned int)card_of(d)->activity.gpm;
    return NVML_SUCCESS;
}

/* Fill `sample`, if it is live, with (card, gi) at the fake clock's now. */
static nvmlReturn_t take_sample(nvmlGpmSample_t sample, int card, long long gi) {
    pthread_mutex_lock(&gpm_lock);
    int i = live_index(sample);
    if (i >= 0) *sample = (struct fake_gpm_sample){1, card, gi, fake_now_s()};
    pthread_mutex_unlock(&gpm_lock);
    return i >= 0 ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* A card, or a MIG handle's GPU instance; a card in MIG mode has no whole-card sample. */
EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample) {
    DEVICE("nvmlGpmSampleGet", device);
    const struct fake_dev *card = card_of(d);
    if (!card->activity.gpm) return NVML_ERROR_NOT_SUPPORTED;
    if (d->slot >= 0) return take_sample(sample, d->card, d->gi);
    if (mig_enabled(card)) return NVML_ERROR_NOT_SUPPORTED;
    return take_sample(sample, d->card, WHOLE_CARD);
}

EXPORT nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t sample) {
    DEVICE("nvmlGpmMigSampleGet", device);
    if (!card_of(d)->activity.gpm) return NVML_ERROR_NOT_SUPPORTED;
    if (d->slot >= 0) return NVML_ERROR_INVALID_ARGUMENT; /* it takes the parent card and a GPU instance id */
    if (!mig_enabled(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (!has_gpu_instance(d, gpuInstanceId)) return NVML_ERROR_NOT_FOUND;
    return take_sample(sample, d->card, gpuInstanceId);
}

/* Reads and writes metrics[0:numMetrics] only, and never the struct's size (see nvmlGpmMetricsGet_t);
 * a metric that fails keeps the value the caller left in it. */
EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *get) {
    int rc = system_call("nvmlGpmMetricsGet");
    if (rc) return rc;
    if (!get) return NVML_ERROR_INVALID_ARGUMENT;
    if (get->version != NVML_GPM_METRICS_GET_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    pthread_mutex_lock(&gpm_lock);
    int live = live_index(get->sample1) >= 0 && live_index(get->sample2) >= 0;
    struct fake_gpm_sample s1 = live ? *get->sample1 : (struct fake_gpm_sample){0};
    struct fake_gpm_sample s2 = live ? *get->sample2 : (struct fake_gpm_sample){0};
    pthread_mutex_unlock(&gpm_lock);
    if (get->numMetrics == 0 || get->numMetrics > GPM_METRICS_MAX_OLDEST || !s1.filled || !s2.filled
        || s1.card != s2.card || s1.gi != s2.gi)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct activity *a = &devs[card_dev[s2.card]].activity;
    /* A GPU instance without a compute instance has no data (DCGM's DcgmGpmManager.cpp skips it and
     * answers blank values): each metric NO_DATA, never a measured 0. */
    int bare = s2.gi != WHOLE_CARD && !has_compute_instance(&devs[card_dev[s2.card]], s2.gi);
    double seconds = s2.at_s - s1.at_s;
    for (unsigned int i = 0; i < get->numMetrics; i++) {
        nvmlGpmMetric_t *m = &get->metrics[i];
        m->nvmlReturn = bare ? NVML_ERROR_NO_DATA : gpm_metric_code(a, m->metricId);
        if (m->nvmlReturn != NVML_SUCCESS) continue;
        double now = percent_at(a, s2.gi, m->metricId, s2.at_s);
        if (!isfinite(now)) m->value = now; /* answered as it is, as the Python fake does */
        else if (seconds < GPM_MIN_INTERVAL_S && seconds > -GPM_MIN_INTERVAL_S) m->value = 0;
        else m->value = (seconds > 0 ? busy_percent_s(a, s2.gi, m->metricId, s1.at_s, s2.at_s)
                                     : -busy_percent_s(a, s2.gi, m->metricId, s2.at_s, s1.at_s)) / seconds;
    }
    return NVML_SUCCESS;
}

/* ---- per-process utilisation samples, made as the fake clock runs ----
 * As the Python fake's _util_make/_util_answer: a card's scripted processes (pactivity) are sampled
 * once a driver period, at each multiple of the period on the fake clock, for the last
 * PROCESS_SAMPLE_BUFFER_S (a card has a full buffer behind it, as under a driver running since
 * boot), a process only while one of its shares is above 0, under the script in force before the
 * sample's time (a line FROM_S on stands for the Python fake's set_scenario at FROM_S). Each is
 * stamped with the fake wall clock at its time: the fake clock plus the wall_clock offset in force
 * before then (as step_wall_clock: the samples already taken keep their stamps). The fixed putil
 * samples come first. putil_merged: one sample a process, its mean (rounded half to even, as
 * Python's round) over those newer than lastSeen, stamped at its newest. */

#define PROCESS_SAMPLE_BUFFER_US 120000000LL
#define DEFAULT_PERIOD_US 166667ULL

struct wall_step { double from_s, offset_s; long long from_us; };
static struct wall_step *wall_steps; /* ordered by from_s */
static int nwall_steps, wall_default_set;
static double wall_default_s; /* with no line: the real wall clock less CLOCK_MONOTONIC, when first asked */

static int wall_clock_line(char **tok) { /* wall_clock OFFSET_S FROM_S */
    struct wall_step s;
    if (decimal(tok[1], &s.offset_s) || !isfinite(s.offset_s)) return -1;
    if (from_time(tok[2], &s.from_s, &s.from_us)) return -1;
    INSERT_BY_FROM(wall_steps, nwall_steps, s);
    return 0;
}

/* The wall clock less the fake clock for a sample taken at at_us. Called under gpm_lock. */
static double wall_offset_at(long long at_us) {
    if (!wall_default_set) {
        struct timespec real, mono;
        clock_gettime(CLOCK_REALTIME, &real);
        clock_gettime(CLOCK_MONOTONIC, &mono);
        wall_default_s = ((double)real.tv_sec - (double)mono.tv_sec) + ((double)real.tv_nsec - (double)mono.tv_nsec) / 1e9;
        wall_default_set = 1;
    }
    double offset = wall_default_s;
    for (int i = 0; i < nwall_steps && wall_steps[i].from_us < at_us; i++) offset = wall_steps[i].offset_s;
    return offset;
}

static long long floor_div(long long a, long long b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

/* The process's shares in the period ending at at_us: its last line starting before; idle before. */
static const unsigned int *shares_at(const struct activity *a, unsigned int pid, long long at_us) {
    static const unsigned int idle[4];
    const unsigned int *shares = idle;
    for (int i = 0; i < a->npscripts && a->pscripts[i].from_us < at_us; i++)
        if (a->pscripts[i].pid == pid) shares = a->pscripts[i].share;
    return shares;
}

/* sum / count rounded half to even, as Python's round (in integers: no libm). */
static unsigned int mean_half_even(unsigned long long sum, unsigned long long count) {
    unsigned long long q = sum / count, r = sum % count;
    return (unsigned int)(q + (2 * r > count || (2 * r == count && (q & 1))));
}

/* The samples the driver holds for this whole card now, newer than lastSeen, in *out (malloc'd;
 * the caller frees): their count, or -1 out of memory. */
static int process_samples(const struct activity *a, unsigned long long lastSeen,
                           nvmlProcessUtilizationSample_t **out) {
    unsigned long long period = a->period_us ? a->period_us : DEFAULT_PERIOD_US;
    unsigned int *pids = NULL;
    int npids = 0;
    for (int i = 0; i < a->npscripts; i++) { /* each pid once, in the order of its first line */
        int seen = 0;
        for (int j = 0; j < npids; j++) seen |= pids[j] == a->pscripts[i].pid;
        if (seen) continue;
        pids = realloc(pids, sizeof(*pids) * (size_t)(npids + 1));
        pids[npids++] = a->pscripts[i].pid;
    }
    pthread_mutex_lock(&gpm_lock);
    long long now_us = (long long)(fake_now_s() * 1e6);
    long long first = npids ? floor_div(now_us - PROCESS_SAMPLE_BUFFER_US, (long long)period) + 1 : 1;
    long long last = npids ? floor_div(now_us, (long long)period) : 0;
    size_t cap = (size_t)a->nputil + (size_t)(last >= first ? last - first + 1 : 0) * (size_t)npids;
    nvmlProcessUtilizationSample_t *all = malloc(sizeof(*all) * (cap ? cap : 1));
    int n = 0;
    if (all) {
        for (int i = 0; i < a->nputil; i++) {
            const struct putil *p = &a->putil[i];
            if (p->at_us > lastSeen)
                all[n++] = (nvmlProcessUtilizationSample_t){p->pid, p->at_us, p->sm, p->mem, p->enc, p->dec};
        }
        for (long long k = first; k <= last; k++) {
            long long at_us = k * (long long)period;
            long long stamp = at_us + (long long)(wall_offset_at(at_us) * 1e6);
            for (int j = 0; j < npids; j++) {
                const unsigned int *s = shares_at(a, pids[j], at_us);
                if ((s[0] || s[1] || s[2] || s[3]) && stamp > 0 && (unsigned long long)stamp > lastSeen)
                    all[n++] = (nvmlProcessUtilizationSample_t){pids[j], (unsigned long long)stamp,
                                                                s[0], s[1], s[2], s[3]};
            }
        }
    }
    pthread_mutex_unlock(&gpm_lock);
    free(pids);
    if (!all) return -1;
    if (a->merged) { /* one a pid, in the order of its first sample: its mean, at its newest stamp */
        int m = 0;
        for (int i = 0; i < n; i++) {
            int j = 0;
            while (j < m && all[j].pid != all[i].pid) j++;
            if (j < m) continue;
            unsigned long long sum[4] = {0}, count = 0;
            unsigned long long newest = 0;
            for (int k = i; k < n; k++) {
                if (all[k].pid != all[i].pid) continue;
                sum[0] += all[k].smUtil, sum[1] += all[k].memUtil, sum[2] += all[k].encUtil, sum[3] += all[k].decUtil;
                if (all[k].timeStamp > newest) newest = all[k].timeStamp;
                count++;
            }
            all[m++] = (nvmlProcessUtilizationSample_t){all[i].pid, newest, mean_half_even(sum[0], count),
                                                        mean_half_even(sum[1], count), mean_half_even(sum[2], count),
                                                        mean_half_even(sum[3], count)};
        }
        n = m;
    }
    *out = all;
    return n;
}

/* NVML: "One utilization sample structure is returned per process running, that had some non-zero
 * utilization during the last sample period": the scenario's samples are those, and the call
 * answers the ones newer than lastSeen (us), NOT_FOUND when there is none; pynvml sizes with a NULL
 * array and reads only after INSUFFICIENT_SIZE. In MIG mode the size query answers 1 and the read
 * is refused: NOT_SUPPORTED on the card, INVALID_ARGUMENT on a MIG handle (a driver-535 report on
 * an H100, .git/issue-39-research.md 1.5), as the Python fake. */
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *samples,
                                                    unsigned int *count, unsigned long long lastSeen) {
    DEVICE("nvmlDeviceGetProcessUtilization", device);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->slot >= 0 || mig_enabled(d)) {
        if (!samples) {
            *count = 1;
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        return d->slot >= 0 ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
    }
    nvmlProcessUtilizationSample_t *held = NULL;
    int found = process_samples(&d->activity, lastSeen, &held);
    if (found < 0) return NVML_ERROR_MEMORY;
    unsigned int n = (unsigned int)found;
    nvmlReturn_t rc = NVML_SUCCESS;
    if (!n) rc = NVML_ERROR_NOT_FOUND;
    else if (!samples || *count < n) rc = NVML_ERROR_INSUFFICIENT_SIZE;
    else memcpy(samples, held, sizeof(*held) * n);
    if (n) *count = n;
    free(held);
    return rc;
}

/* ---- for tests/test_fake_libnvml.py: this file's layouts, to compare with pynvml's ---- */

#define LAYOUT(T, f) if (!strcmp(what, #T "." #f)) return (long)offsetof(T, f);
#define SIZE(T) if (!strcmp(what, #T)) return (long)sizeof(T);

EXPORT long fakeNvmlLayout(const char *what) {
    SIZE(nvmlMemory_t) LAYOUT(nvmlMemory_t, total) LAYOUT(nvmlMemory_t, free) LAYOUT(nvmlMemory_t, used)
    SIZE(nvmlMemory_v2_t) LAYOUT(nvmlMemory_v2_t, version) LAYOUT(nvmlMemory_v2_t, total)
    LAYOUT(nvmlMemory_v2_t, reserved) LAYOUT(nvmlMemory_v2_t, free) LAYOUT(nvmlMemory_v2_t, used)
    SIZE(nvmlProcessInfo_v1_t) LAYOUT(nvmlProcessInfo_v1_t, pid) LAYOUT(nvmlProcessInfo_v1_t, usedGpuMemory)
    SIZE(nvmlProcessInfo_t) LAYOUT(nvmlProcessInfo_t, pid) LAYOUT(nvmlProcessInfo_t, usedGpuMemory)
    LAYOUT(nvmlProcessInfo_t, gpuInstanceId) LAYOUT(nvmlProcessInfo_t, computeInstanceId)
    SIZE(nvmlPciInfo_t) LAYOUT(nvmlPciInfo_t, busIdLegacy) LAYOUT(nvmlPciInfo_t, domain) LAYOUT(nvmlPciInfo_t, bus)
    LAYOUT(nvmlPciInfo_t, device) LAYOUT(nvmlPciInfo_t, pciDeviceId) LAYOUT(nvmlPciInfo_t, pciSubSystemId)
    LAYOUT(nvmlPciInfo_t, busId)
    SIZE(nvmlUtilization_t) LAYOUT(nvmlUtilization_t, gpu) LAYOUT(nvmlUtilization_t, memory)
    SIZE(nvmlTemperature_v1_t) LAYOUT(nvmlTemperature_v1_t, version) LAYOUT(nvmlTemperature_v1_t, sensorType)
    LAYOUT(nvmlTemperature_v1_t, temperature)
    SIZE(nvmlFieldValue_t) LAYOUT(nvmlFieldValue_t, fieldId) LAYOUT(nvmlFieldValue_t, scopeId)
    LAYOUT(nvmlFieldValue_t, timestamp) LAYOUT(nvmlFieldValue_t, latencyUsec) LAYOUT(nvmlFieldValue_t, valueType)
    LAYOUT(nvmlFieldValue_t, nvmlReturn) LAYOUT(nvmlFieldValue_t, value)
    SIZE(nvmlProcessUtilizationSample_t) LAYOUT(nvmlProcessUtilizationSample_t, pid)
    LAYOUT(nvmlProcessUtilizationSample_t, timeStamp) LAYOUT(nvmlProcessUtilizationSample_t, smUtil)
    LAYOUT(nvmlProcessUtilizationSample_t, memUtil) LAYOUT(nvmlProcessUtilizationSample_t, encUtil)
    LAYOUT(nvmlProcessUtilizationSample_t, decUtil)
    SIZE(nvmlUnrepairableMemory_v1_t) LAYOUT(nvmlUnrepairableMemory_v1_t, version)
    LAYOUT(nvmlUnrepairableMemory_v1_t, unrepairableMemory)
    SIZE(nvmlEventData_t) LAYOUT(nvmlEventData_t, device) LAYOUT(nvmlEventData_t, eventType) /* XID events' */
    LAYOUT(nvmlEventData_t, eventData) LAYOUT(nvmlEventData_t, gpuInstanceId) LAYOUT(nvmlEventData_t, computeInstanceId)
    SIZE(nvmlGpmSupport_t) LAYOUT(nvmlGpmSupport_t, version) LAYOUT(nvmlGpmSupport_t, isSupportedDevice)
    SIZE(nvmlGpmMetric_t) LAYOUT(nvmlGpmMetric_t, metricId) LAYOUT(nvmlGpmMetric_t, nvmlReturn)
    LAYOUT(nvmlGpmMetric_t, value) LAYOUT(nvmlGpmMetric_t, metricInfo)
    SIZE(nvmlGpmMetricInfo_t) LAYOUT(nvmlGpmMetricInfo_t, shortName) LAYOUT(nvmlGpmMetricInfo_t, longName)
    LAYOUT(nvmlGpmMetricInfo_t, unit)
    /* no SIZE: the metrics array's bound is the binding's (see nvmlGpmMetricsGet_t) */
    LAYOUT(nvmlGpmMetricsGet_t, version) LAYOUT(nvmlGpmMetricsGet_t, numMetrics)
    LAYOUT(nvmlGpmMetricsGet_t, sample1) LAYOUT(nvmlGpmMetricsGet_t, sample2) LAYOUT(nvmlGpmMetricsGet_t, metrics)
    if (!strcmp(what, "nvmlMemory_v2")) return (long)nvmlMemory_v2;
    if (!strcmp(what, "nvmlTemperature_v1")) return (long)nvmlTemperature_v1;
    SIZE(nvmlMarginTemperature_v1_t) LAYOUT(nvmlMarginTemperature_v1_t, version)
    LAYOUT(nvmlMarginTemperature_v1_t, marginTemperature)
    SIZE(nvmlEccSramErrorStatus_v1_t) LAYOUT(nvmlEccSramErrorStatus_v1_t, version)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncParity) LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncSecDed)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateCor) LAYOUT(nvmlEccSramErrorStatus_v1_t, volatileUncParity)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, volatileUncSecDed) LAYOUT(nvmlEccSramErrorStatus_v1_t, volatileCor)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncBucketL2) LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncBucketSm)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncBucketPcie)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncBucketMcu)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, aggregateUncBucketOther)
    LAYOUT(nvmlEccSramErrorStatus_v1_t, bThresholdExceeded)
    SIZE(nvmlRowRemapperHistogramValues_t) LAYOUT(nvmlRowRemapperHistogramValues_t, max)
    LAYOUT(nvmlRowRemapperHistogramValues_t, high) LAYOUT(nvmlRowRemapperHistogramValues_t, partial)
    LAYOUT(nvmlRowRemapperHistogramValues_t, low) LAYOUT(nvmlRowRemapperHistogramValues_t, none)
    SIZE(nvmlRepairStatus_v1_t) LAYOUT(nvmlRepairStatus_v1_t, version)
    LAYOUT(nvmlRepairStatus_v1_t, bChannelRepairPending) LAYOUT(nvmlRepairStatus_v1_t, bTpcRepairPending)
#define CONSTANT(name) if (!strcmp(what, #name)) return (long)(name);
    CONSTANT(nvmlMarginTemperature_v1) CONSTANT(nvmlEccSramErrorStatus_v1) CONSTANT(nvmlRepairStatus_v1)
    CONSTANT(NVML_CLOCK_COUNT) CONSTANT(NVML_TEMPERATURE_THRESHOLD_COUNT) CONSTANT(NVML_MEMORY_LOCATION_COUNT)
    CONSTANT(NVML_MEMORY_LOCATION_SRAM) CONSTANT(NVML_MEMORY_ERROR_TYPE_UNCORRECTED) CONSTANT(NVML_VOLATILE_ECC)
    CONSTANT(NVML_PAGE_RETIREMENT_CAUSE_COUNT) CONSTANT(NVML_VALUE_TYPE_UNSIGNED_INT)
    CONSTANT(NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION) CONSTANT(NVML_FI_DEV_PCIE_REPLAY_COUNTER) CONSTANT(RETIRED_AT)
    CONSTANT(NVML_GPM_SUPPORT_VERSION) CONSTANT(NVML_GPM_METRICS_GET_VERSION)
    return -1;
}
