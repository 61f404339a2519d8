/* tests/reset.h -- forget everything ltg's store, logs, ledger and caches
 * hold, as if it had just started: tests/unit.c and tests/fuzz.c include
 * this after ../ltg.c, so one test's state never leaks into the next. */
static void store_reset(void) {
    for (int i = 0; i < ST.gv.n; i++) group_free(ST.gv.p[i]);
    for (int i = 0; i < ST.kv.n; i++) tkey_free(ST.kv.p[i]);
    for (size_t i = 0; i < ST.idems.cap; i++) /* both planes' idempotency records */
        if (ST.idems.slot[i] && ST.idems.slot[i] != HMAP_TOMB) idem_free(ST.idems.slot[i]);
    free(ST.gv.p), free(ST.kv.p), free(ST.iv.p);
    free(ST.groups.slot), free(ST.keys.slot), free(ST.keys_by_hash.slot), free(ST.idems.slot);
    memset(&ST, 0, sizeof ST);
    store_init();
    if (LOG.f.fd >= 0) close(LOG.f.fd);
    if (LOG.tmp_fd >= 0) close(LOG.tmp_fd);
    buf_free(&LOG.tail), buf_free(&LOG.f.pending);
    memset(&LOG, 0, sizeof LOG);
    LOG.f.fd = LOG.tmp_fd = -1;
    while (LG.nseg) {
        segment *s = LG.seg[--LG.nseg];
        if (s->f.fd >= 0) close(s->f.fd);
        seg_free(s);
    }
    free(LG.seg);
    memset(&LG, 0, sizeof LG);
    timer_stop(&ledger_sync_timer);
    while (CACHE.head) cache_drop(CACHE.head);
    CL.applied[0] = 0;
}
