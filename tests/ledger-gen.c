/* tests/ledger-gen.c -- a history for the benchmark, written through ltg's own ledger code.
 *
 *     tests/ledger-gen DATA EVENTS DAYS GROUPS [INDEX_MB]
 *
 * Writes DATA/state.log with GROUPS token groups (budgets of 1d, 7d, 30d and
 * lifetime, in turn, anchored DAYS days ago) and two token keys each (with
 * budgets of their own: 1d, 7d, 30d, 1mo and lifetime, in turn), and
 * DATA/ledger/ with EVENTS spend events spread evenly over the DAYS days that
 * end now: each day sealed with its index file as ltg seals it at midnight,
 * today's left open. DAYS 0 puts every event in today (UTC), spread evenly
 * from its midnight to now (anchors at that midnight). Event i is of key
 * i % (2 x GROUPS), whose group is key / 2, so a key has every
 * (2 x GROUPS)-th event and a group two in every 2 x GROUPS; events are in
 * time order (equal times when there are more events than milliseconds).
 *
 * It includes ltg.c (without main) and calls ledger_add() with the clock of
 * each event, so the files are exactly ltg's: with --ledger-index-mb INDEX_MB
 * (default 16), the open day's index in memory is spilled to its index file
 * in sealed chunks as ltg spills it (synchronously, inside ledger_add()).
 * With LEDGER_KEY in the environment, the days are chained with that key (as
 * ltg --ledger-key-env LEDGER_KEY chains them).
 * Prints one group id and one key id for the benchmark's filtered queries
 * (group 3 and key 6, or the last of each when there are fewer).
 */
#define LTG_NO_MAIN
#include "../ltg.c"

static void gen_group(const char *id, int i, int64_t anchor) {
    static const int periods[] = {1, 7, 30, 0};
    buf p = {0};
    buf_printf(&p, "{\"ops\":[{\"put_group\":{\"id\":\"%s\",\"name\":\"bench-%d\",\"allowed_models\":[\"Bench-Model\"],\"fallbacks\":{},"
                   "\"retries\":null,\"max_budget\":1000000,\"budget_duration\":%s%s%s,\"cache_ttl\":null,\"max_parallel_requests\":null,"
                   "\"blocked\":false,\"version\":1,\"created_at\":%lld,\"updated_at\":%lld,\"budget_anchor\":%lld}}]}",
               id, i, periods[i % 4] ? "\"" : "", periods[i % 4] == 1 ? "1d" : periods[i % 4] == 7 ? "7d" : periods[i % 4] == 30 ? "30d" : "null",
               periods[i % 4] ? "\"" : "", (long long)anchor, (long long)anchor, (long long)anchor);
    const char *why;
    if (state_append(p.p, p.len, &why) < 0) { fprintf(stderr, "ledger-gen: %s\n", why); exit(1); }
    buf_free(&p);
}

static void gen_key(const char *id, const char *gid, int i, int64_t at) {
    static const char *const periods[] = {"\"1d\"", "\"7d\"", "\"30d\"", "\"1mo\"", "null"};
    char p[640];
    snprintf(p, sizeof p, "{\"ops\":[{\"put_key\":{\"id\":\"%s\",\"name\":\"bench-key-%d\",\"token_group_id\":\"%s\",\"version\":1,"
                          "\"sha256\":\"%064d\",\"created_at\":%lld,\"updated_at\":%lld,\"max_budget\":1000000,\"budget_duration\":%s,"
                          "\"budget_anchor\":%lld}}]}", id, i, gid, i, (long long)at, (long long)at, periods[i % 5], (long long)at);
    const char *why;
    if (state_append(p, strlen(p), &why) < 0) { fprintf(stderr, "ledger-gen: %s\n", why); exit(1); }
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) { fprintf(stderr, "usage: tests/ledger-gen DATA EVENTS DAYS GROUPS [INDEX_MB]\n"); return 2; }
    const char *data = argv[1];
    long long n = atoll(argv[2]);
    int days = atoi(argv[3]), ngroups = atoi(argv[4]), nkeys = 2 * ngroups, index_mb = argc == 6 ? atoi(argv[5]) : 16;
    if (n < 1 || days < 0 || ngroups < 1) { fprintf(stderr, "ledger-gen: EVENTS and GROUPS must be >= 1, DAYS >= 0\n"); return 2; }
    if (index_mb < 1 || index_mb > 4096) { fprintf(stderr, "ledger-gen: INDEX_MB must be 1..4096 (as --ledger-index-mb)\n"); return 2; }
    char err[512];
    mkdir(data, 0700);
    options_default();
    S.ledger_index = (long long)index_mb << 20;
    S.ledger_days = 90, S.now = clock_ms();
    if (getenv("LEDGER_KEY") && (LG.keyed = 1) && ledger_key("LEDGER_KEY", &LG.key, err, sizeof err) < 0) { fprintf(stderr, "ledger-gen: %s\n", err); return 2; }
    store_init();
    if (log_open(&LOG.f, data, "state.log", LOG_MAGIC, 0, store_apply, NULL, err, sizeof err) < 0) { fprintf(stderr, "ledger-gen: %s\n", err); return 1; }
    int64_t now = wall_ms(), start = days ? now - (int64_t)days * DAY_MS : day_of(now); /* DAYS 0: today, from its midnight */
    char (*gid)[37] = xcalloc((size_t)ngroups, 37), (*kid)[37] = xcalloc((size_t)nkeys, 37);
    for (int i = 0; i < ngroups; i++) uuid_new(gid[i]), gen_group(gid[i], i, start);
    for (int i = 0; i < nkeys; i++) uuid_new(kid[i]), gen_key(kid[i], gid[i / 2], i, start);
    if (ledger_open(data, start, err, sizeof err) < 0) { fprintf(stderr, "ledger-gen: %s\n", err); return 1; }
    static const char *const models[] = {"Bench-Model", "Bench-Fallback", "Bench-Mini"};
    int64_t day = day_of(start);
    for (long long i = 0; i < n; i++) {
        int64_t at = start + (int64_t)((double)(now - start) * (double)i / (double)n);
        if (day_of(at) != day) { /* midnight: sync, seal yesterday, write its index file */
            ledger_sync(NULL);
            S.now += IDX_RETRY_MS + 1;
            ledger_tick(at);
            day = day_of(at);
        }
        int k = (int)(i % nkeys), m = (int)(i % 7 == 0 ? 1 : i % 5 == 0 ? 2 : 0);
        char ev[900], ts[64], id[37];
        iso_time(at, ts);
        uuid_new(id);
        int len = snprintf(ev, sizeof ev,
                           "{\"id\":\"%s\",\"record_type\":\"spend_event\",\"request_id\":\"req_%024llx\",\"created_at\":\"%s\","
                           "\"token_key_id\":\"%s\",\"token_group_id\":\"%s\",\"requested_model\":\"Bench-Model\",\"model\":\"%s\","
                           "\"attempts\":%d,\"status\":\"succeeded\",\"http_status\":200,\"cache_hit\":false,\"input_tokens\":20,"
                           "\"output_tokens\":3,\"cost\":0.000020,\"usage_status\":\"reported\",\"latency_ms\":12,\"attempt_log\":["
                           "%s{\"model\":\"%s\",\"attempt\":1,\"status\":200,\"outcome\":\"ok\",\"ms\":11}]}",
                           id, i, ts, kid[k], gid[k / 2], models[m], m == 1 ? 2 : 1,
                           m == 1 ? "{\"model\":\"Bench-Model\",\"attempt\":1,\"status\":503,\"outcome\":\"indeterminate\",\"ms\":1,\"error\":\"answered 503\"}," : "",
                           models[m]);
        rec_view v = {.charged = 20, .tok = {[TOK_IN] = 20, [TOK_OUT] = 3}, .status = EV_SUCCEEDED, .key = kid[k], .group = gid[k / 2],
                      .model = models[m], .model_len = strlen(models[m]), .event = ev, .event_len = (size_t)len, .replay = ""};
        int64_t d;
        uint64_t off;
        uint32_t rlen;
        if (ledger_add(&v, at, &d, &off, &rlen) < 0) return 1;
        if (i % 65536 == 65535) ledger_sync(NULL);
    }
    ledger_sync(NULL);
    const char *why;
    if (!ledger_writable(&why)) { fprintf(stderr, "ledger-gen: %s\n", why); return 1; }
    printf("%s %s\n", gid[ngroups > 3 ? 3 : ngroups - 1], kid[nkeys > 6 ? 6 : nkeys - 1]);
    return 0;
}
