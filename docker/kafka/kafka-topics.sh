#!/bin/bash
# kafka-topics.sh at the official image's path (/opt/kafka/bin), for the compose file's health
# check and topic creator
exec java -cp '/opt/kafka/libs/*' -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties \
  org.apache.kafka.tools.TopicCommand "$@"
