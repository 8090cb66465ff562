/* A stranger on the host for tests/test_fabric_strangers.py: a bare libfabric
 * client that knows only a rank's endpoint names and sends it messages
 * tagged in the engine's old, unkeyed layout (source rank 16 bits | pair
 * sequence 24 | chunk 24), as issue 27's probe did. Usage:
 *   unkeyed_sender PROVIDER SRC_RANK SEQS SECONDS NAMEHEX... -- PAYLOAD_FILE...
 * Sends every payload (in the order given: small ones, which ride the eager
 * path, first), to every name, under the tags of pair sequences 0..SEQS-1
 * and chunk 0: ahead of the job, they would sit in the receiver's unexpected
 * queue and answer its later receives. Prints "sent N" (sends the provider
 * took). Sends no receive matches (rendezvous) stay pending until SECONDS. */
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

static void drain(struct fid_cq* cq) {
  struct fi_cq_tagged_entry ev[16];
  ssize_t n;
  while ((n = fi_cq_read(cq, ev, 16)) > 0 || n == -FI_EAVAIL) {
    if (n == -FI_EAVAIL) {
      struct fi_cq_err_entry e;
      memset(&e, 0, sizeof e);
      fi_cq_readerr(cq, &e, 0);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 7) return fprintf(stderr, "usage: unkeyed_sender PROVIDER SRC SEQS SECONDS NAMEHEX... -- FILE...\n"), 2;
  const uint64_t src = strtoull(argv[2], NULL, 10);
  const long seqs = strtol(argv[3], NULL, 10);
  const double until = now() + strtod(argv[4], NULL);
  int sep = 5;
  while (sep < argc && strcmp(argv[sep], "--")) ++sep;
  const int nnames = sep - 5, nfiles = argc - sep - 1;
  if (nnames < 1 || nfiles < 1) return fprintf(stderr, "need names and payload files\n"), 2;
  char** bufs = calloc(nfiles, sizeof *bufs);
  size_t* lens = calloc(nfiles, sizeof *lens);
  for (int f = 0; f < nfiles; ++f) {
    FILE* fp = fopen(argv[sep + 1 + f], "rb");
    if (!fp) return perror(argv[sep + 1 + f]), 2;
    fseek(fp, 0, SEEK_END);
    lens[f] = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    bufs[f] = malloc(lens[f] ? lens[f] : 1);
    if (fread(bufs[f], 1, lens[f], fp) != lens[f]) return fprintf(stderr, "short read\n"), 2;
    fclose(fp);
  }
  struct fi_info *hints = fi_allocinfo(), *info = NULL;
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_TAGGED | FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->fabric_attr->prov_name = strdup(argv[1]);
  CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
  struct fid_fabric* fabric;
  struct fid_domain* domain;
  struct fid_cq* cq;
  struct fid_av* av;
  struct fid_ep* ep;
  struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED};
  struct fi_av_attr ava = {.type = FI_AV_TABLE};
  CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
  CHECK(fi_domain(fabric, info, &domain, NULL));
  CHECK(fi_cq_open(domain, &cqa, &cq, NULL));
  CHECK(fi_av_open(domain, &ava, &av, NULL));
  CHECK(fi_endpoint(domain, info, &ep, NULL));
  CHECK(fi_ep_bind(ep, &av->fid, 0));
  CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_enable(ep));
  fi_addr_t* addrs = calloc(nnames, sizeof *addrs);
  for (int i = 0; i < nnames; ++i) {
    const char* hex = argv[5 + i];
    size_t n = strlen(hex) / 2;
    unsigned char* name = malloc(n);
    for (size_t k = 0; k < n; ++k) sscanf(hex + 2 * k, "%2hhx", &name[k]);
    if (fi_av_insert(av, name, 1, &addrs[i], 0, NULL) != 1) return fprintf(stderr, "fi_av_insert failed\n"), 2;
    free(name);
  }
  /* One context per send: the provider may hold each until its rendezvous ends. */
  const long most = seqs * nnames * nfiles;
  struct fi_context2* ctx = calloc(most ? most : 1, sizeof *ctx);
  long sent = 0;
  for (int f = 0; f < nfiles; ++f)
    for (long seq = 0; seq < seqs; ++seq)
      for (int i = 0; i < nnames; ++i) {
        const uint64_t tag = (src & 0xFFFF) << 48 | ((uint64_t)seq & 0xFFFFFF) << 24;
        ssize_t rc;
        while ((rc = fi_tsend(ep, bufs[f], lens[f], NULL, addrs[i], tag, &ctx[sent])) == -FI_EAGAIN && now() < until)
          drain(cq);
        if (rc) goto out; /* the provider holds no more (pending rendezvous) or the time is up */
        ++sent;
        drain(cq);
      }
out:
  for (double end = now() + 1.0; now() < end;) drain(cq);
  printf("sent %ld\n", sent);
  fflush(stdout);
  _Exit(0); /* pending rendezvous sends: no orderly close to wait for */
}
