/* A stranger that floods a rank with connections, for
 * tests/test_fabric_strangers.py: it knows only the rank's endpoint names
 * (from the job's store) and not the secret. Each round opens a new
 * endpoint, sends every name one small message (rxm connects to send it),
 * waits for the send to complete, and closes the endpoint, which tears the
 * connection down on the rank's side. Usage:
 *   flood PROVIDER ROUNDS SECONDS NAMEHEX...
 * Stops after ROUNDS rounds or SECONDS, whichever comes first, and prints
 * "connections N" (the sends that completed: each one a connection the rank
 * accepted and later saw torn). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, strdup */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                        \
  do {                                                                     \
    int rc_ = (int)(call);                                                 \
    if (rc_) {                                                             \
      fprintf(stderr, "%s: %s\n", #call, fi_strerror(-rc_));               \
      return 2;                                                            \
    }                                                                      \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The completions read, errors included (a rank that refused counts as none). */
static long completions(struct fid_cq* cq) {
  struct fi_cq_tagged_entry ev[16];
  long ok = 0;
  ssize_t n;
  while ((n = fi_cq_read(cq, ev, 16)) > 0 || n == -FI_EAVAIL) {
    if (n == -FI_EAVAIL) {
      struct fi_cq_err_entry e;
      memset(&e, 0, sizeof e);
      fi_cq_readerr(cq, &e, 0);
    } else {
      ok += n;
    }
  }
  return ok;
}

int main(int argc, char** argv) {
  if (argc < 5) return fprintf(stderr, "usage: flood PROVIDER ROUNDS SECONDS NAMEHEX...\n"), 2;
  const long rounds = strtol(argv[2], NULL, 10);
  const double until = now() + strtod(argv[3], NULL);
  const int nnames = argc - 4;
  struct fi_info *hints = fi_allocinfo(), *info = NULL;
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_TAGGED | FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->fabric_attr->prov_name = strdup(argv[1]);
  CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
  struct fid_fabric* fabric;
  struct fid_domain* domain;
  CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
  CHECK(fi_domain(fabric, info, &domain, NULL));
  unsigned char** names = calloc(nnames, sizeof *names);
  for (int i = 0; i < nnames; ++i) {
    const char* hex = argv[4 + i];
    size_t n = strlen(hex) / 2;
    names[i] = malloc(n);
    for (size_t k = 0; k < n; ++k) sscanf(hex + 2 * k, "%2hhx", &names[i][k]);
  }
  char msg[64] = "not a peer";
  struct fi_context2* ctx = calloc(nnames, sizeof *ctx);
  long connections = 0;
  for (long r = 0; r < rounds && now() < until; ++r) {
    struct fid_cq* cq;
    struct fid_av* av;
    struct fid_ep* ep;
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED};
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    CHECK(fi_cq_open(domain, &cqa, &cq, NULL));
    CHECK(fi_av_open(domain, &ava, &av, NULL));
    CHECK(fi_endpoint(domain, info, &ep, NULL));
    CHECK(fi_ep_bind(ep, &av->fid, 0));
    CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_enable(ep));
    long posted = 0, done = 0;
    for (int i = 0; i < nnames; ++i) {
      fi_addr_t a;
      if (fi_av_insert(av, names[i], 1, &a, 0, NULL) != 1) return fprintf(stderr, "fi_av_insert failed\n"), 2;
      ssize_t rc;
      while ((rc = fi_tsend(ep, msg, sizeof msg, NULL, a, (uint64_t)r << 8 | i, &ctx[i])) == -FI_EAGAIN &&
             now() < until)
        done += completions(cq);
      posted += rc == 0;
    }
    for (double end = now() + 1.0; done < posted && now() < end;) done += completions(cq);
    connections += done;
    fi_close(&ep->fid);
    fi_close(&av->fid);
    fi_close(&cq->fid);
  }
  printf("connections %ld\n", connections);
  fflush(stdout);
  return 0;
}
