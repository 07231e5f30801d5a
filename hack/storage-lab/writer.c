/* The storage lab's writer (docs/snapshot.md, "Testing"): appends numbered, checksummed 64-byte
 * records to FILE, fdatasync(2) after each, and logs "SEQ EPOCH_SECONDS" to ACKS once the
 * record is durable. A snapshot must hold a gap-free prefix of the records that includes every
 * record acknowledged before the round's barrier went up. Usage: writer FILE ACKS [PERIOD_MS] */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;
static void on_term(int s) { (void)s; stop = 1; }

static uint32_t fnv1a(const char *p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 16777619u;
  return h;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: writer FILE ACKS [PERIOD_MS]\n"); return 2; }
  long period = argc > 3 ? atol(argv[3]) : 20;
  signal(SIGTERM, on_term); signal(SIGINT, on_term);
  int fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND, 0644);
  FILE *acks = fopen(argv[2], "a");
  if (fd < 0 || !acks) { perror("open"); return 1; }
  off_t end = lseek(fd, 0, SEEK_END);
  unsigned long long seq = (unsigned long long)end / 64;
  while (!stop) {
    char rec[65];
    seq++;
    int n = snprintf(rec, sizeof rec, "seq=%010llu", seq);
    snprintf(rec + n, sizeof rec - n, " sum=%08x", fnv1a(rec, n));
    memset(rec + strlen(rec), '.', 63 - strlen(rec));
    rec[63] = '\n';
    if (write(fd, rec, 64) != 64 || fdatasync(fd) != 0) { perror("write"); return 1; }
    struct timespec t; clock_gettime(CLOCK_REALTIME, &t);
    fprintf(acks, "%llu %lld.%09ld\n", seq, (long long)t.tv_sec, t.tv_nsec);
    fflush(acks);
    struct timespec d = {period / 1000, (period % 1000) * 1000000L};
    nanosleep(&d, NULL);
  }
  return 0;
}
